"""`ModelShard`: the decoder layers `[start, end)` of a causal LM, with a KV cache per session.

The head shard (start == 0) also holds the tokenizer and the embeddings; the tail shard (end == total layers) also
holds the final norm and the LM head and samples the next token. A shard keeps only the weights it serves
(`weights`). Hidden states come and go as raw bytes with a shape and a dtype name (`tensors`). This is the
`ShardBackend` the transport and the head call; it knows nothing of sockets.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from .backend import DecodeStep, PrefillRun, PrefillStep, StepResult, TailTokenResult, TensorPayload, TokenLogprob
from .batched import Rows, decode_rows, prefill_rows, prefills_together
from .kv.cache_store import KVCacheMiss, SessionCacheStore
from .compiled import compile_lean
from .text.constraints import Grammars
from .shard_facts import ShardFacts
from .gguf.gguf_model import GgufModel
from .kv.kv_blocks import footprint
from .kv.kv_copies import StandbyRows
from .memory import default_cache_budget, give_back, map_large_allocations, process_memory, tensor_bytes
from .kernels.native import kernels
from .text.sampling import prompt_token_logprobs, token_logprobs, verify_drafts
from .text.sampling_params import DEFAULT as GREEDY, SamplingParams
from .session_layers import SessionLayers, fork as fork_cache
from .settings import ShardLayout, ShardSettings
from .shard_parts import ShardParts, gguf_parts, lean_problem, transformers_parts
from .source import ResolvedModel, load_tokenizer, locate_model
from .tensors import cache_length, payload_from_tensor, positions, tensor_from_bytes
from .weights import eos_ids

log = logging.getLogger("meshws.shard")


class ModelShard(ShardFacts, StandbyRows):
    def __init__(self, model: str | ResolvedModel | None, start: int, end: int | None = None,
                 settings: ShardSettings | None = None, cache_dir: Path | str | None = None) -> None:
        self.settings, self.dtype_reason = (settings or ShardSettings()).checked()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        started = time.monotonic()
        resolved = model if isinstance(model, ResolvedModel) else locate_model(model, cache_dir)
        self.resolved, self.cache_dir = resolved, cache_dir
        self.model_id = resolved.model_id
        parts = self._load(resolved, start, end)
        if self.settings.dtype_was_auto:
            log.info("compute: %s (%s)", self.settings.dtype, self.dtype_reason)
        self.tokenizer = load_tokenizer(resolved) if parts.layout.is_head else None
        map_large_allocations()  # (KV blocks and work buffers freed are given back at once)
        self.sessions = SessionCacheStore(max_sessions=self.settings.max_sessions, ttl_seconds=self.settings.cache_ttl,
                                          max_bytes=None, measure=cache_length, emptied=give_back,
                                          footprint=footprint)
        self.compile_seconds: float | None = None
        self.lm_head_seconds = 0.0  # in the LM head and choosing tokens so far (a tail weighs them apart: `speed`)
        self._use(parts)
        # Structured output, on a tail: masks need the tokenizer (the head's; a tail loads it at its first grammar).
        self.grammars = Grammars(lambda: self.tokenizer or load_tokenizer(resolved), self.vocab_size)
        self._eos_ids = parts.eos_ids if parts.gguf is not None else eos_ids(resolved.folder, parts.model.config,
                                                                              self.tokenizer)
        if parts.gguf is not None and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self._eos_ids = list(dict.fromkeys([*self._eos_ids, int(self.tokenizer.eos_token_id)]))
        memory = process_memory()
        log.info("layers %d-%d of %s (%s): %.0f MiB of weights; process resident %.0f MiB, peak %.0f MiB; "
                 "ready in %.1f s", start, self.end - 1, self.model_id, self.compute_path,
                 self.weight_bytes / 2**20, memory["resident_bytes"] / 2**20, memory["peak_resident_bytes"] / 2**20,
                 time.monotonic() - started)

    def _use(self, parts: ShardParts) -> None:
        """Serve `parts`: what depends on the span (the layers, their weights' bytes, the KV budget)."""
        self.parts = parts
        self.layout, self.lean, self.model = parts.layout, parts.lean, parts.model
        if self.lean is not None:
            self.lean.use_kv_dtype(self.settings.kv_dtype)
        self.compute_dtype, self.hidden_size = parts.compute_dtype, parts.hidden_size
        self.vocab_size = parts.vocab_size
        self.context_length = min(parts.context_length, self.settings.ctx_size or parts.context_length)
        self.matmul, self.matmul_reason = parts.matmul
        self.weight_bytes = parts.gguf.mapped_bytes() if parts.gguf is not None else \
            tensor_bytes(self.held_tensors()) + (self.lean.kept_bytes if self.lean else 0)
        self.sessions.max_bytes = self._cache_budget()
        self.layers = SessionLayers(parts.run, parts.new_cache, self.sessions, self.start,
                                    label=f"model {self.model_id}")
        self.rows: Rows = parts.rows
        self.supports_batching = self.rows.fits  # else decode_batch runs the steps one by one
        if self.settings.compile:
            self.compile_seconds = compile_lean(self, self.cache_dir)

    def _cache_budget(self) -> int | None:
        """The KV caches' byte budget: --max-cache-bytes; else what --memory leaves beside the weights; else half
        the memory free now."""
        if self.settings.max_cache_bytes is not None:
            return self.settings.max_cache_bytes
        if self.settings.memory is not None:
            return max(0, self.settings.memory - self.weight_bytes)
        budget = default_cache_budget()
        if budget is not None and not hasattr(self, "layers"):  # (said once, at start)
            log.info("KV cache budget %.0f MiB (half the memory free now; --max-cache-bytes or --memory sets it)",
                     budget / 2**20)
        return budget

    def prepare_span(self, start: int, end: int) -> ShardParts:
        """A move's first half, on any thread while this shard serves: `[start, end)` loaded beside it (the file
        mapped again; pages shared with the span served now stay one copy in the page cache)."""
        if (start == 0) != self.is_head:
            raise ValueError("a move keeps a head a head and a later shard a later shard")
        return self._load(self.resolved, start, end)

    def adopt(self, parts: ShardParts) -> int:
        """A move's second half, on the compute thread: serve `parts` from now on. Every session's cache goes (its
        layers did), and so do the old span's weights once nothing holds them. The sessions released."""
        released = self.sessions.clear()
        self._use(parts)
        give_back()
        log.info("moved to layers %d-%d: %.0f MiB of weights (%d sessions released)", self.start, self.end - 1,
                 self.weight_bytes / 2**20, released)
        return released

    def _load(self, resolved: ResolvedModel, start: int, end: int | None) -> ShardParts:
        """The lean path on a GGUF's blocks where it can run, else the transformers path (and why)."""
        if resolved.gguf is None:
            return transformers_parts(resolved, self.settings, start, end)
        gguf = GgufModel(resolved.gguf)
        arch, native = gguf.architecture(), kernels() if self.settings.compute != "transformers" else None
        problem = lean_problem(gguf, arch, native, self.settings)
        if problem:
            if self.settings.compute == "lean" or self.settings.quant:
                raise ValueError(f"{resolved.model_id}: the lean path cannot run it: {problem}")
            (log.info if self.settings.compute == "transformers" else log.warning)(
                "%s runs on the transformers path, its weights dequantized in memory: %s", resolved.model_id, problem)
            return transformers_parts(resolved, self.settings, start, end, fallback=problem)
        assert arch is not None and native is not None
        end = arch.layers if end is None else end
        if not 0 <= start < end <= arch.layers:
            raise ValueError(f"layer range [{start}, {end}) is not within the model's {arch.layers} layers")
        if self.settings.dtype_was_auto or self.settings.dtype != "float32":
            self.dtype_reason = "a GGUF's blocks multiply 8-bit activations, as llama.cpp does (--dtype float32: " \
                                "exact float32 products)"
        return gguf_parts(resolved, gguf, arch, ShardLayout(arch.layers, start, end), self.settings, native)

    # -- facts --------------------------------------------------------------

    total_layers = property(lambda self: self.layout.total_layers)
    start = property(lambda self: self.layout.start)
    end = property(lambda self: self.layout.end)
    is_head = property(lambda self: self.layout.is_head)
    is_tail = property(lambda self: self.layout.is_tail)

    supports_kv_cache = property(lambda self: self.layers.supports_kv_cache)

    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; adds the model's BOS unless the text already starts with it."""
        tokenizer = self._need_tokenizer()
        add_special = not (tokenizer.bos_token and text.startswith(tokenizer.bos_token))
        return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(token_ids), skip_special_tokens=True)

    # -- the seed's API -----------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int], session_id: str | None = None, *,
                      sampling: SamplingParams | None = None, generated_from: int | None = None) -> StepResult:
        """Prefill: embed the prompt (text or token ids) and run this shard's layers.

        A re-prefill passes prompt + tokens so far, with `generated_from` = the
        prompt's length. A shard that is head and tail at once (a full node)
        answers with the token.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt has no tokens")
        return self.run_tokens(ids, session_id, "prefill" if session_id else None, 0, sampling, ids, generated_from)

    def encode_next_token(self, token_id: int, session_id: str, *, sampling: SamplingParams | None = None,
                          history: Sequence[int] = (), generated_from: int | None = None,
                          past_len: int | None = None) -> StepResult:
        """One decode step on the head: a single token against the session's cache (cut back to `past_len`)."""
        if not self.supports_kv_cache:
            raise KVCacheMiss("caching is off on this shard; re-prefill")
        if past_len is None:
            past_len = self.sessions.lookup(session_id).seq_len
        return self.run_tokens([int(token_id)], session_id, "decode", past_len, sampling, history, generated_from)

    def forward_bytes(self, body: bytes, shape: Sequence[int], *, dtype: str = "bfloat16",
                      session_id: str | None = None, cache_mode: str | None = None, past_len: int | None = None,
                      sampling: SamplingParams | None = None, history: Sequence[int] = (),
                      generated_from: int | None = None) -> StepResult:
        """Run this shard's layers on hidden states received from the previous hop.

        `cache_mode` "prefill" starts the session's cache at position 0; "decode"
        extends it at `past_len` (one token, or a chunk). With no session the step
        runs stateless over the whole sequence.
        """
        return self._forward(body, shape, dtype, session_id, cache_mode, past_len, sampling, history, generated_from)

    def _forward(self, body: bytes, shape: Sequence[int], dtype: str, session_id: str | None, cache_mode: str | None,
                 past_len: int | None, sampling: SamplingParams | None, history: Sequence[int],
                 generated_from: int | None, drafts: Sequence[int] = ()) -> StepResult:
        if cache_mode not in (None, "prefill", "decode"):
            raise ValueError(f"unknown cache mode {cache_mode!r}")
        hidden = self.tensor_from_bytes(body, shape, dtype)
        past = int(past_len or 0) if cache_mode == "decode" else 0
        with torch.inference_mode():
            hidden = self.layers.run(hidden, positions(past, hidden.shape[1]), session_id,
                                     cache_mode if session_id else None, past)
            return self.finish(hidden, past, sampling, history, generated_from, drafts)

    def release_session(self, session_id: str) -> bool:
        return self.sessions.drop(session_id)

    def fork_session(self, parent_id: str, session_id: str, length: int) -> bool:
        return self.supports_kv_cache and fork_cache(self.sessions, parent_id, session_id, length, self.start)

    def run_tokens(self, ids: list[int], session_id: str | None, mode: str | None, past_len: int,
                   sampling: SamplingParams | None = None, history: Sequence[int] = (),
                   generated_from: int | None = None, drafts: Sequence[int] = ()) -> StepResult:
        """Embed `ids` at `past_len` and run them through (a prefill, a decode step or a chunk)."""
        with torch.inference_mode():
            hidden = self.embed(ids)
            hidden = self.layers.run(hidden, positions(past_len, len(ids)), session_id, mode, past_len)
            return self.finish(hidden, past_len, sampling, history, generated_from, drafts)

    # -- continuous batching ------------------------------------------------

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StepResult | Exception]:
        """Several sessions' one-token decode steps as one forward through the layers (`batched.decode_rows`)."""
        return decode_rows(self, steps)

    def prefills_together(self, step: PrefillStep) -> bool:  # may it join other new sessions' prompts in one call?
        return prefills_together(self, step)

    def prefill_batch(self, steps: Sequence[PrefillStep],
                      decodes: Sequence[DecodeStep] = ()) -> list[StepResult | Exception]:  # in one call (`batched`)
        return prefill_rows(self, steps, decodes)

    # -- chunked prefill ----------------------------------------------------

    def prefill(self, step: PrefillStep, chunk_tokens: int) -> PrefillRun:
        """A prefill (or a multi-token step) in chunks of `chunk_tokens`, pausing (yield) between chunks.

        Each chunk after the first extends the session's cache like a decode step, so
        the result is the one-shot prefill's. Stateless steps run whole.
        """
        count = step.length
        start = step.past_len if step.mode == "decode" else 0
        if step.mode not in ("prefill", "decode"):
            raise ValueError(f"unknown cache mode {step.mode!r}")
        if not step.session_id or count <= chunk_tokens or not self.supports_kv_cache or step.drafts:
            return self._prefill_whole(step)
        if step.token_ids is not None:
            self._check_ids(step.token_ids)
            whole = None
        else:
            whole = self.tensor_from_bytes(step.body or b"", step.shape, step.dtype)
        outputs: list[torch.Tensor] = []
        prompt_logprobs: list[TokenLogprob] = []  # on a tail, when the prompt's own are asked for
        for offset in range(0, count, chunk_tokens):
            if offset and not self.supports_kv_cache:  # the cache path failed on this hardware meanwhile
                return self._prefill_whole(step)
            end = min(count, offset + chunk_tokens)
            mode = "prefill" if step.mode == "prefill" and offset == 0 else "decode"
            with torch.inference_mode():
                piece = self.embed(step.token_ids[offset:end]) if whole is None else whole[:, offset:end]
                out = self.layers.run(piece, positions(start + offset, end - offset), step.session_id, mode,
                                      start + offset)
                history = step.history or (list(step.token_ids) if step.token_ids is not None else ())
                if self.is_tail:  # the prompt's own log-probabilities, when asked for (echo)
                    prompt_logprobs += prompt_token_logprobs(self.last_logits, out, start + offset, step.sampling,
                                                             history, step.generated_from)
                if not self.is_tail:  # (a tail needs only the last chunk's last row: held, a slice keeps its chunk)
                    outputs.append(out)
                if end == count:
                    hidden = torch.cat(outputs, dim=1) if not self.is_tail else out[:, -1:]
                    past = start if not self.is_tail else start + count - 1
                    result = self.finish(hidden, past, step.sampling, history, step.generated_from)
                    return replace(result, prompt_logprobs=tuple(prompt_logprobs)) if prompt_logprobs else result
            yield
        raise AssertionError("unreachable: the last chunk returns")

    def _prefill_whole(self, step: PrefillStep) -> StepResult:
        if step.token_ids is not None:
            start = step.past_len if step.mode == "decode" else 0
            return self.run_tokens([int(t) for t in step.token_ids], step.session_id, step.mode, start,
                                   step.sampling, step.history or list(step.token_ids), step.generated_from,
                                   step.drafts)
        return self._forward(step.body or b"", step.shape, step.dtype, step.session_id, step.mode, step.past_len,
                             step.sampling, step.history, step.generated_from, step.drafts)

    def _check_ids(self, ids: Sequence[int]) -> None:
        for token in ids:
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """Embeddings `[1, len(ids), hidden]`; ValueError for an id outside the vocabulary."""
        self._check_ids(ids)
        rows = self.parts.embed(torch.tensor([int(t) for t in ids], dtype=torch.long))
        return rows.to(self.compute_dtype).unsqueeze(0)

    # -- bytes <-> tensors and the last step ---------------------------------

    def tensor_from_bytes(self, body: bytes | memoryview, shape: Sequence[int], dtype: str) -> torch.Tensor:
        return tensor_from_bytes(body, shape, dtype, self.hidden_size, self.compute_dtype)

    def finish(self, hidden: torch.Tensor, past_len: int, sampling: SamplingParams | None, history: Sequence[int],
               generated_from: int | None, drafts: Sequence[int] = (),
               logits: torch.Tensor | None = None) -> StepResult:
        """The step's result: on the tail, its token(s) chosen from `logits` (of its last positions; computed here
        unless given); elsewhere, the hidden states to send on."""
        if not self.is_tail:
            return payload_from_tensor(hidden, past_len, self.settings.wire_dtype)
        position, sampling, grammar = past_len + hidden.shape[1], sampling or GREEDY, (sampling or GREEDY).grammar
        if len(drafts) >= hidden.shape[1]:
            raise ValueError(f"{len(drafts)} drafts need more than the step's {hidden.shape[1]} positions")
        constraint = self.grammars.matcher(grammar, history[generated_from or len(history):]) if grammar else None
        # The last len(drafts) + 1 positions each choose a token: the drafts are kept while they are the choice.
        began, before = time.perf_counter(), self.lm_head_seconds
        logits = self.last_logits(hidden, len(drafts) + 1) if logits is None else logits
        tokens = verify_drafts(logits, sampling, position - len(drafts), drafts, history, generated_from, constraint)
        self.lm_head_seconds = before + time.perf_counter() - began  # the LM head and the choice: a tail's own work
        if constraint is not None:
            self.grammars.keep(grammar, constraint)
        reported = () if sampling.logprobs is None else \
            tuple(token_logprobs(logits, sampling, tokens, history, generated_from))
        prompt = () if drafts or past_len else \
            prompt_token_logprobs(self.last_logits, hidden, 0, sampling, history, generated_from)
        return TailTokenResult(text="", token_id=tokens[-1], token_ids=tuple(tokens) if drafts else (),
                               logprobs=reported, prompt_logprobs=tuple(prompt))

    def last_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Logits of the last position (`[vocab]`), or of the last `rows` positions (`[rows, vocab]`)."""
        if self.parts.lm_head is None:
            raise RuntimeError("only a tail shard holds the LM head")
        last = hidden[0, -1, :] if rows is None else hidden[0, -rows:, :]
        began = time.perf_counter()
        logits = self.parts.lm_head(last)
        self.lm_head_seconds += time.perf_counter() - began
        softcap = self.parts.softcap
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RuntimeError("only a head shard holds the tokenizer")
        return self.tokenizer


__all__ = ["ModelShard", "ShardLayout", "ShardSettings", "TailTokenResult", "TensorPayload"]
