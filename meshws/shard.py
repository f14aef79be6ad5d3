"""A model shard: the decoder layers `[start, end)` of a causal LM, with a KV cache per session.

The head shard (start == 0) also holds the tokenizer and the embeddings; the
tail shard (end == total layers) also holds the final norm and the LM head and
samples the next token. A shard keeps only the weights it serves: it builds a
model with `end - start` layers, renumbered from 0, and reads just those
tensors from the safetensors file. Hidden states cross between shards as raw
little-endian bytes with a shape and a dtype name; nothing is pickled.

This module knows nothing of sockets; `shard_server` hands it decoded frames.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .cache_store import KVCacheMiss, SessionCacheStore
from .compute import DecodeStep
from .model_source import ResolvedModel, resolve_model
from .sampling import DEFAULT as GREEDY
from .row_attention import ROWS_ATTENTION, RowCaches, rows_attention_fits
from .sampling import SamplingParams, sample_token
from .weights import build_shard_model, eos_ids, shard_config
from .wire import DTYPE_SIZES

log = logging.getLogger("meshws.shard")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert set(TORCH_DTYPES) == set(DTYPE_SIZES)  # the wire and the shard agree on dtype names


@dataclass(frozen=True)
class TensorPayload:
    """Hidden states on their way to the next hop."""

    body: bytes
    shape: list[int]
    attention_mask_header: str | None = None
    position_ids_header: str | None = None
    past_len: int = 0  # tokens the session's caches held before this step
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class TailTokenResult:
    """What a tail answers: the sampled token (text is optional; the head detokenises)."""

    text: str
    token_id: int | None


@dataclass
class ShardLayout:
    total_layers: int
    start: int
    end: int

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.total_layers


@dataclass
class ShardSettings:
    dtype: str = "float32"  # compute dtype: float32 or bfloat16
    wire_dtype: str = "bfloat16"  # dtype of hidden states sent to the next hop
    max_sessions: int = 64  # KV caches held at once (LRU beyond)
    cache_ttl: float = 600.0  # seconds an idle session's cache is kept
    max_cache_bytes: int | None = None  # byte budget for all KV caches (LRU beyond)
    threads: int | None = None  # torch intra-op threads; None = torch's default
    extra: dict[str, Any] = field(default_factory=dict)


class ModelShard:
    def __init__(
        self,
        model: str | ResolvedModel | None,
        start: int,
        end: int | None = None,
        settings: ShardSettings | None = None,
        cache_dir: Path | str | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.settings = settings or ShardSettings()
        if self.settings.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.settings.dtype!r}")
        if self.settings.wire_dtype not in TORCH_DTYPES:
            raise ValueError(f"wire dtype must be one of {sorted(TORCH_DTYPES)}")
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        resolved = model if isinstance(model, ResolvedModel) else resolve_model(model, cache_dir)
        self.model_id = resolved.model_id
        self.folder = resolved.folder
        config = AutoConfig.from_pretrained(str(resolved.folder))
        total = config.num_hidden_layers
        end = total if end is None else end
        if not 0 <= start < end <= total:
            raise ValueError(f"layer range [{start}, {end}) is not within the model's {total} layers")
        self.layout = ShardLayout(total, start, end)
        self.config = config
        self.compute_dtype = TORCH_DTYPES[self.settings.dtype]
        self.wire_dtype = self.settings.wire_dtype
        self.hidden_size = config.hidden_size
        self.context_length = getattr(config, "max_position_embeddings", None) or 2048
        self.shard_config = shard_config(config, start, end)
        self.model = build_shard_model(resolved.folder, self.shard_config, self.layout, self.compute_dtype)
        self.tokenizer = None
        if self.layout.is_head:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(resolved.folder))
        self.sessions = SessionCacheStore(
            max_sessions=self.settings.max_sessions,
            ttl_seconds=self.settings.cache_ttl,
            max_bytes=self.settings.max_cache_bytes,
        )
        self.supports_kv_cache = True
        self.batched_decode = rows_attention_fits(self.model)  # else decode_batch runs steps one by one
        self._rotary_by_type = "layer_type" in inspect.signature(self.model.model.rotary_emb.forward).parameters
        self._eos_ids = eos_ids(resolved.folder, config, self.tokenizer)

    # -- facts --------------------------------------------------------------

    @property
    def total_layers(self) -> int:
        return self.layout.total_layers

    @property
    def start(self) -> int:
        return self.layout.start

    @property
    def end(self) -> int:
        return self.layout.end

    @property
    def is_head(self) -> bool:
        return self.layout.is_head

    @property
    def is_tail(self) -> bool:
        return self.layout.is_tail

    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    def parameter_count(self) -> int:
        seen: set[int] = set()
        count = 0
        for param in self.model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        return count

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; adds the model's BOS unless the text already starts with it."""
        tokenizer = self._need_tokenizer()
        bos = tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(token_ids), skip_special_tokens=True)

    # -- the seed's API -----------------------------------------------------

    def encode_prompt(
        self,
        prompt: str | Sequence[int],
        session_id: str | None = None,
        *,
        sampling: SamplingParams | None = None,
        generated_from: int | None = None,
    ) -> TensorPayload | TailTokenResult:
        """Prefill: embed the prompt (text or token ids) and run this shard's layers.

        A re-prefill passes prompt + tokens so far, with `generated_from` = the
        prompt's length. A shard that is head and tail at once (a full node)
        answers with the token.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt has no tokens")
        mode = "prefill" if session_id else None
        return self._step_tokens(ids, session_id, mode, 0, sampling, ids, generated_from)

    def encode_next_token(
        self,
        token_id: int,
        session_id: str,
        *,
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        generated_from: int | None = None,
    ) -> TensorPayload | TailTokenResult:
        """One decode step on the head: a single token against the session's cache."""
        if not self.supports_kv_cache:
            raise KVCacheMiss("caching is disabled on this shard")
        past_len = self.sessions.lookup(session_id).seq_len
        return self._step_tokens([int(token_id)], session_id, "decode", past_len, sampling, history, generated_from)

    def forward_bytes(
        self,
        body: bytes,
        shape: Sequence[int],
        attention_mask_header: str | None,
        position_ids_header: str | None,
        start_layer: int | None = None,
        session_id: str | None = None,
        cache_mode: str | None = None,
        past_len: int | None = None,
        *,
        dtype: str = "bfloat16",
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        generated_from: int | None = None,
    ) -> TensorPayload | TailTokenResult:
        """Run this shard's layers on hidden states received from the previous hop.

        `cache_mode` "prefill" starts the session's cache at position 0; "decode"
        extends it at `past_len` (one token, or a chunk). With no session the step
        runs stateless over the whole sequence.
        """
        if attention_mask_header is not None or position_ids_header is not None:
            raise ValueError("explicit masks and positions are not supported: positions follow past_len")
        if cache_mode not in (None, "prefill", "decode"):
            raise ValueError(f"unknown cache mode {cache_mode!r}")
        hidden = self.tensor_from_bytes(body, shape, dtype)
        past = int(past_len or 0) if cache_mode == "decode" else 0
        with torch.inference_mode():
            positions = _positions(past, hidden.shape[1])
            hidden = self._run_layers_session(
                hidden,
                None,
                positions,
                session_id=session_id,
                cache_mode=cache_mode if session_id else None,
                past_len=past,
                start_layer=start_layer,
            )
            return self._finish(hidden, past, sampling, history, generated_from)

    def release_session(self, session_id: str) -> bool:
        return self.sessions.drop(session_id)

    # -- continuous batching ------------------------------------------------

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[TensorPayload | TailTokenResult | Exception]:
        """Several sessions' one-token decode steps as one forward through the layers.

        Each session keeps its own cache and past length; the projections and MLPs
        read the weights once for all rows, attention runs per row against that
        row's cache. A step that cannot run (cache miss, bad bytes) gets its own
        exception and the others go on.
        """
        results: list[Any] = [None] * len(steps)
        rows: list[tuple[int, Any, torch.Tensor, int]] = []  # (index, entry, hidden, past_len)
        with torch.inference_mode():
            for index, step in enumerate(steps):
                try:
                    rows.append((index, *self._prepare_decode(step)))
                except (KVCacheMiss, ValueError) as exc:
                    results[index] = exc
            if len(rows) == 1 or (rows and not self.batched_decode):
                for index, *_ in rows:
                    results[index] = self._decode_alone(steps[index])
                return results
            if not rows:
                return results
            hidden = torch.cat([row[2] for row in rows])
            positions = torch.tensor([[row[3]] for row in rows], dtype=torch.long)
            try:
                hidden = self._run_layers_rows(hidden, positions, [row[1].cache for row in rows])
            except Exception as exc:  # never fail every session for one batched call; say why once
                log.warning("batched decode failed (%s); running these steps one by one from now on", exc)
                self.batched_decode = False
                for index, entry, _, past in rows:
                    self.sessions.drop(steps[index].session_id)
                    results[index] = KVCacheMiss(f"batched step failed: {exc}")
                return results
            for position, (index, entry, _, past) in enumerate(rows):
                step = steps[index]
                entry.seq_len = past + 1
                try:
                    self.sessions.resize(step.session_id, cache_nbytes(entry.cache))
                    results[index] = self._finish(hidden[position : position + 1], past, step.sampling,
                                                  step.history, step.generated_from)
                except Exception as exc:
                    results[index] = exc
        return results

    def _prepare_decode(self, step: DecodeStep) -> tuple[Any, torch.Tensor, int]:
        """The session's cache entry, the step's input hidden state and its past length."""
        if not self.supports_kv_cache:
            raise KVCacheMiss("caching is disabled on this shard")
        if step.token_id is not None:
            entry = self.sessions.lookup(step.session_id)
            hidden = self.model.model.embed_tokens(torch.tensor([[int(step.token_id)]], dtype=torch.long))
        else:
            hidden = self.tensor_from_bytes(step.body or b"", step.shape, step.dtype)
            if hidden.shape[1] != 1:
                raise ValueError("a batched decode step carries exactly one token")
            entry = self.sessions.lookup(step.session_id, expected_seq_len=step.past_len,
                                         effective_start=self.start)
        return entry, hidden, entry.seq_len

    def _decode_alone(self, step: DecodeStep) -> TensorPayload | TailTokenResult | Exception:
        try:
            if step.token_id is not None:
                return self.encode_next_token(step.token_id, step.session_id, sampling=step.sampling,
                                              history=step.history, generated_from=step.generated_from)
            return self.forward_bytes(step.body or b"", step.shape, None, None, session_id=step.session_id,
                                      cache_mode="decode", past_len=step.past_len, dtype=step.dtype,
                                      sampling=step.sampling, history=step.history,
                                      generated_from=step.generated_from)
        except Exception as exc:
            return exc

    def _run_layers_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        """The layers over a batch of one-token rows, each attending to its own cache."""
        base = self.model.model
        config = self.model.config
        row_caches = RowCaches(caches)
        layer_types = getattr(config, "layer_types", None)
        if self._rotary_by_type:
            embeddings = {kind: base.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
        else:
            shared = base.rotary_emb(hidden, position_ids=positions)
        previous = config._attn_implementation
        config._attn_implementation = ROWS_ATTENTION
        try:
            for index, layer in enumerate(base.layers):
                output = layer(
                    hidden,
                    attention_mask=None,
                    position_embeddings=embeddings[layer_types[index]] if self._rotary_by_type else shared,
                    position_ids=positions,
                    cache=row_caches,
                    use_cache=True,
                )
                hidden = output[0] if isinstance(output, tuple) else output
        finally:
            config._attn_implementation = previous
        return base.norm(hidden)

    # -- bytes <-> tensors -------------------------------------------------

    def tensor_from_bytes(self, body: bytes | memoryview, shape: Sequence[int], dtype: str) -> torch.Tensor:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        shape = [int(n) for n in shape]
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != self.hidden_size:
            raise ValueError(f"hidden states must have shape [1, tokens, {self.hidden_size}], got {shape}")
        expected = shape[0] * shape[1] * shape[2] * DTYPE_SIZES[dtype]
        if len(body) != expected:
            raise ValueError(f"body has {len(body)} bytes, shape {shape} x {dtype} needs {expected}")
        # One copy into memory we own (torch will not wrap read-only bytes), then the cast.
        tensor = torch.frombuffer(bytearray(body), dtype=TORCH_DTYPES[dtype]).view(shape)
        return tensor.to(self.compute_dtype)

    def payload_from_tensor(self, hidden: torch.Tensor, past_len: int) -> TensorPayload:
        wire = hidden.to(TORCH_DTYPES[self.wire_dtype]).contiguous()
        body = wire.view(torch.uint8).numpy().tobytes()
        return TensorPayload(body=body, shape=list(wire.shape), past_len=past_len, dtype=self.wire_dtype)

    # -- internals (names kept from the seed so its unit tests port) --------

    def _step_tokens(
        self,
        ids: list[int],
        session_id: str | None,
        cache_mode: str | None,
        past_len: int,
        sampling: SamplingParams | None,
        history: Sequence[int],
        generated_from: int | None = None,
    ) -> TensorPayload | TailTokenResult:
        with torch.inference_mode():
            hidden = self.model.model.embed_tokens(torch.tensor([ids], dtype=torch.long))
            hidden = self._run_layers_session(
                hidden,
                None,
                _positions(past_len, len(ids)),
                session_id=session_id,
                cache_mode=cache_mode,
                past_len=past_len,
            )
            return self._finish(hidden, past_len, sampling, history, generated_from)

    def _finish(
        self,
        hidden: torch.Tensor,
        past_len: int,
        sampling: SamplingParams | None,
        history: Sequence[int],
        generated_from: int | None,
    ) -> TensorPayload | TailTokenResult:
        if not self.is_tail:
            return self.payload_from_tensor(hidden, past_len)
        logits = self.last_logits(hidden)
        position = past_len + hidden.shape[1]
        token_id = sample_token(logits, sampling or GREEDY, position, history, generated_from)
        return TailTokenResult(text="", token_id=token_id)

    def last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden[0, -1, :])
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def _effective_start(self, start_layer: int | None = None) -> int:
        if start_layer is not None and start_layer != self.start:
            raise ValueError(f"this shard starts at layer {self.start}, not {start_layer}")
        return self.start

    def _new_session_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.shard_config)

    def _run_layers(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        *,
        start_layer: int | None = None,
        cache: Any = None,
        past_len: int = 0,
    ) -> torch.Tensor:
        output = self.model.model(
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return output.last_hidden_state

    def _run_layers_session(
        self,
        hidden_states: Any,
        attention_mask: Any,
        position_ids: Any,
        *,
        session_id: str | None = None,
        cache_mode: str | None = None,
        past_len: int = 0,
        start_layer: int | None = None,
    ) -> Any:
        """Run the layers against the session's cache; stateless when there is none.

        If the cached path itself fails (the seed's Triton-on-CPU case), caching is
        turned off for good and a prefill is retried stateless; a decode step cannot
        be redone without its cache, so it answers a cache miss and the head
        re-prefills.
        """
        effective_start = self._effective_start(start_layer)
        if session_id is None or cache_mode is None:
            return self._run_layers(hidden_states, attention_mask, position_ids, start_layer=start_layer)
        if not self.supports_kv_cache:
            if cache_mode == "decode":
                raise KVCacheMiss("caching is disabled on this shard; re-prefill")
            return self._run_layers(hidden_states, attention_mask, position_ids, start_layer=start_layer)
        entry = None
        if cache_mode == "prefill":
            cache = self._new_session_cache()
        else:
            entry = self.sessions.lookup(session_id, expected_seq_len=past_len, effective_start=effective_start)
            cache = entry.cache
        try:
            output = self._run_layers(
                hidden_states, attention_mask, position_ids, start_layer=start_layer, cache=cache, past_len=past_len
            )
        except Exception as exc:
            self._disable_cache(exc)
            if cache_mode == "decode":
                raise KVCacheMiss(f"cached step failed ({exc}); caching is now off") from exc
            return self._run_layers(hidden_states, attention_mask, position_ids, start_layer=start_layer)
        seq_len = past_len + hidden_states.shape[1]
        if entry is None:
            self.sessions.store(session_id, cache, seq_len, effective_start, nbytes=cache_nbytes(cache))
        else:
            entry.seq_len = seq_len
            self.sessions.resize(session_id, cache_nbytes(cache))
        return output

    def _disable_cache(self, exc: Exception) -> None:
        if self.supports_kv_cache:
            log.warning("model %s: the cached path failed (%s); serving stateless from now on", self.model_id, exc)
        self.supports_kv_cache = False
        self.sessions.clear()

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError("only a head shard holds the tokenizer")
        return self.tokenizer


def cache_nbytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


def _positions(past_len: int, count: int) -> torch.Tensor:
    return torch.arange(past_len, past_len + count, dtype=torch.long).unsqueeze(0)
