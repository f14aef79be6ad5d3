"""Batched decode: several sessions' one-token steps as one forward through a shard's layers.

The rows run through the decoder layers as one tensor `[rows, 1, hidden]`, so
projections, MLPs and norms read the weights once. Only attention differs per row:
`RowCaches.update` appends each row's new key and value to that session's cache and
hands back per-row lists, and the attention function registered under
`ROWS_ATTENTION` runs HF's own sdpa code row by row.

`decode_rows` is a shard's `decode_batch`: each row's failure stays its own. A
batched forward that raises is undone (each row's cache cropped back) and its rows
run one by one, so only a row at fault gets the error; batching is switched off only
when the batched path itself cannot run on this hardware.

`prefill_rows` is a shard's `prefill_batch`: several new sessions' prompts as rows of
one call of the fused kernel (`prefills_together` says which may join), so the weights
are read once for all of them. A row's bits do not depend on its batch there, so each
session gets what its prefill alone gives.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from typing import Any, Protocol, Sequence

import torch

from .backend import DecodeStep, PrefillStep, ShardBackend, StepResult, decode_alone
from .kv.cache_store import CacheEntry, KVCacheMiss
from .text.sampling_params import SamplingParams
from .session_layers import cannot_run_here, cut_back
from .kernels.native import threads as kernel_threads
from .tensors import cache_nbytes, crop_cache

log = logging.getLogger("meshws.shard")


class Rows(Protocol):
    """Runs one-token rows `[rows, 1, hidden]`, each against its own session cache (`RowRunner`, `lean.LeanLayers`)."""

    fits: bool

    def run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: list[Any]) -> torch.Tensor: ...


class RowShard(ShardBackend, Protocol):
    """What `decode_rows` needs of a shard (`ModelShard`): the backend, its row runner and its last step."""

    rows: Rows

    def embed(self, ids: Sequence[int]) -> torch.Tensor: ...

    def tensor_from_bytes(self, body: bytes | memoryview, shape: Sequence[int], dtype: str) -> torch.Tensor: ...

    def finish(self, hidden: torch.Tensor, past_len: int, sampling: SamplingParams | None,
               history: Sequence[int], generated_from: int | None, drafts: Sequence[int] = (),
               logits: torch.Tensor | None = None) -> StepResult: ...

    def last_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor: ...


Row = tuple[int, CacheEntry, torch.Tensor, int]  # (index in the steps, cache entry, hidden state, past length)

ROWS_ATTENTION = "meshws_rows"


class RowCaches:
    """A cache stand-in for a batch of rows: each row updates its own session's cache."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            key, value = cache.update(key_states[row : row + 1], value_states[row : row + 1], layer_idx)
            keys.append(key)
            values.append(value)
        return keys, values


def _rows_attention(module: Any, query: torch.Tensor, key: Any, value: Any, attention_mask: Any,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each row's one query against its own keys, with the sdpa code HF uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("sliding_window", None)  # the cache already holds only the window
    outputs = [
        sdpa_attention_forward(module, query[row : row + 1], key[row], value[row], None, **kwargs)[0]
        for row in range(query.shape[0])
    ]
    return torch.cat(outputs), None


def rows_attention_fits(model: Any) -> bool:
    """Batched decode needs plain sdpa-style attention (no logit soft-capping); registers it if so."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or config._attn_implementation not in ("sdpa", None):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(ROWS_ATTENTION, _rows_attention)
    return True


class RowRunner:
    """Runs a causal LM's decoder layers over a batch of one-token rows, each with its own cache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fits = rows_attention_fits(model)
        # Gemma-3 keeps one rotary table per layer type; Llama one for all layers.
        self._rotary_by_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters

    def run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        base, config = self.model.model, self.model.config
        row_caches = RowCaches(caches)
        layer_types = getattr(config, "layer_types", None)
        if self._rotary_by_type:
            by_type = {kind: base.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
        else:
            shared = base.rotary_emb(hidden, position_ids=positions)
        previous = config._attn_implementation
        config._attn_implementation = ROWS_ATTENTION
        try:
            for index, layer in enumerate(base.layers):
                output = layer(
                    hidden,
                    attention_mask=None,
                    position_embeddings=by_type[layer_types[index]] if self._rotary_by_type else shared,
                    position_ids=positions,
                    cache=row_caches,
                    use_cache=True,
                )
                hidden = output[0] if isinstance(output, tuple) else output
        finally:
            config._attn_implementation = previous
        return base.norm(hidden)


def decode_rows(shard: RowShard, steps: Sequence[DecodeStep]) -> list[StepResult | Exception]:
    """Several sessions' one-token decode steps as one forward through `shard`'s layers.

    Each session keeps its own cache and past length. A step that cannot run
    (cache miss, bad bytes, a token id outside the vocabulary) gets its own exception
    and the others go on.
    """
    results: list[StepResult | Exception | None] = [None] * len(steps)
    rows: list[Row] = []
    with torch.inference_mode():
        for index, step in enumerate(steps):
            try:
                rows.append((index, *_prepare(shard, step)))
            except (KVCacheMiss, ValueError) as exc:
                results[index] = exc
        if len(rows) == 1 or (rows and not shard.supports_batching):
            for index, *_ in rows:
                results[index] = _alone(shard, steps[index])
            return results  # type: ignore[return-value]
        if not rows:
            return results  # type: ignore[return-value]
        hidden = torch.cat([row[2] for row in rows])
        row_positions = torch.tensor([[row[3]] for row in rows], dtype=torch.long)
        try:
            hidden = shard.rows.run_rows(hidden, row_positions, [row[1].cache for row in rows])
        except Exception as exc:  # one row may be at fault: each row alone, so only it fails
            _rows_alone(shard, steps, rows, results, exc)
            return results  # type: ignore[return-value]
        logits = _logits_at_once(shard, hidden)
        for position, (index, entry, _, past) in enumerate(rows):
            results[index] = _decoded(shard, steps[index], entry, past, hidden[position : position + 1],
                                      None if logits is None else logits[position : position + 1])
    return results  # type: ignore[return-value]


def _logits_at_once(shard: RowShard, hidden: torch.Tensor) -> torch.Tensor | None:
    """On a tail, the logits of rows `hidden` (`[rows, 1, width]`) in one product: the LM head's weights are read
    once, not per row. None elsewhere, or if the product fails (then each row's own, so only a row at fault fails)."""
    if not shard.is_tail:
        return None
    try:
        return shard.last_logits(hidden.reshape(1, hidden.shape[0], hidden.shape[-1]), hidden.shape[0])
    except Exception:
        return None


def _decoded(shard: RowShard, step: DecodeStep, entry: CacheEntry, past: int, hidden: torch.Tensor,
             logits: torch.Tensor | None) -> StepResult | Exception:
    """A decode row's result, once its cache holds the step (`past + 1` positions): its own exception if it fails."""
    entry.seq_len = past + 1
    try:
        shard.sessions.resize(step.session_id, cache_nbytes(entry.cache))
        return shard.finish(hidden, past, step.sampling, step.history, step.generated_from, logits=logits)
    except Exception as exc:
        return exc


def _rows_alone(shard: RowShard, steps: Sequence[DecodeStep], rows: list[Row],
                results: list[StepResult | Exception | None], exc: Exception) -> None:
    """After a failed batch: each row's cache back to its past length, then each row on its own."""
    for index, entry, _, past in rows:
        try:
            crop_cache(entry.cache, past)  # layers the batch reached hold one position too many
        except Exception:
            shard.sessions.drop(steps[index].session_id)
        results[index] = _alone(shard, steps[index])
    if cannot_run_here(exc) and not any(isinstance(results[index], Exception) for index, *_ in rows):
        log.warning("batched decode cannot run here (%s); decode steps run one by one from now on", exc)
        shard.supports_batching = False
    else:
        log.warning("a batch of %d decode steps failed (%s); its rows ran one by one", len(rows), exc)


def _alone(shard: RowShard, step: DecodeStep) -> StepResult | Exception:
    try:
        return decode_alone(shard, step)
    except Exception as exc:
        return exc


def _prepare(shard: RowShard, step: DecodeStep) -> tuple[CacheEntry, torch.Tensor, int]:
    """The session's cache entry, the step's input hidden state and its past length."""
    if not shard.supports_kv_cache:
        raise KVCacheMiss("caching is off on this shard; re-prefill")
    if step.token_id is not None:  # on the head: its own cache says where the step goes, unless told
        hidden = shard.embed([step.token_id])
        entry = shard.sessions.lookup(step.session_id) if step.past_len is None else \
            cut_back(shard.sessions, step.session_id, step.past_len, shard.start)
    else:
        hidden = shard.tensor_from_bytes(step.body or b"", step.shape, step.dtype)
        if hidden.shape[1] != 1:
            raise ValueError("a batched decode step carries exactly one token")
        entry = cut_back(shard.sessions, step.session_id, step.past_len, shard.start)
    return entry, hidden, entry.seq_len


def prefills_together(shard: Any, step: PrefillStep) -> bool:
    """May `step` join other sessions' prefills in one call (`prefill_rows`)? A new session's prompt that the
    fused kernel takes whole, as the session's prefill alone would run (`LeanLayers.run`), where a call of several
    prompts costs no more than their calls apart: on AMX tiles (the cost is reading the weights, shared by every
    row), and on a GGUF's blocks. Head + tail of the embedded GGUF (tiles laid out once for all of a call's rows),
    16 sessions joining at once (39-token prompts, 32 tokens each), alternating runs: 8-bit products 410-422 ->
    452-463 tok/s and the p95 gap 41-57 -> 25-31 ms; float32 186-190 -> 212-215 tok/s, p95 gap 128-167 -> 49-55
    ms (one prompt a call, each new session's first token stretched every running session's next gap, one prompt
    after another). The synthetic 1B Q4_K_M, bound by arithmetic: 52 tok/s either way, p95 gap 423 -> 198 ms,
    first tokens 3.4 -> 3.9 s (p50). Elsewhere (float weights without tiles) one call of five prompts cost what
    five calls did, while it held the other sessions' next step for all of that time (fp32, 16 sessions: p95 gap
    188 -> 329 ms)."""
    lean = shard.lean
    return (lean is not None and lean.fused is not None and (lean.fused.amx or lean.on_blocks)
            and shard.supports_kv_cache and shard.supports_batching  # (off: the batched path cannot run here)
            and step.mode == "prefill" and bool(step.session_id) and not step.drafts
            and 0 < step.length <= lean.fused_rows)


def prefill_rows(shard: Any, steps: Sequence[PrefillStep],
                 decodes: Sequence[DecodeStep] = ()) -> list[StepResult | Exception]:
    """New sessions' prefills (each `prefills_together`) as the rows of one fused call, and with them other
    sessions' decode steps, one row each: a wave rides along the prompts instead of reading the weights on its
    own, and is held by them no longer than by the prompts' turn. Every session gets its own cache (a prompt's
    stored once the call is done) and what its step alone gives. Results in the order of `[*steps, *decodes]`; a
    step at fault (bad ids or bytes, a cache miss) gets its exception; a failed call raises, leaving the caches
    as each step alone would find them (cut back to its `past_len`, as a step does first; then each runs alone)."""
    lean = shard.lean
    results: list[StepResult | Exception | None] = [None] * (len(steps) + len(decodes))
    rows: list[tuple[int, torch.Tensor]] = []  # (index in the steps, hidden states [1, tokens, width])
    riding: list[Row] = []  # the decode steps'
    with torch.inference_mode():
        for index, step in enumerate(steps):
            try:
                rows.append((index, shard.embed(step.token_ids) if step.token_ids is not None else
                             shard.tensor_from_bytes(step.body or b"", step.shape, step.dtype)))
            except ValueError as exc:
                results[index] = exc
        for index, decode in enumerate(decodes, start=len(steps)):
            try:
                entry, hidden, past = _prepare(shard, decode)
                entry.cache.reserve(past + 1, past)
                riding.append((index, entry, hidden, past))
            except (KVCacheMiss, ValueError) as exc:
                results[index] = exc
        caches = [lean.new_cache() for _ in rows]
        for cache, (_, hidden) in zip(caches, rows):
            cache.reserve(hidden.shape[1])
        pasts = [past for *_, past in riding] + [position for _, hidden in rows for position in range(hidden.shape[1])]
        if not pasts:
            return results  # type: ignore[return-value]
        cos, sin = lean.rope(torch.tensor(pasts), max(pasts) + 1)[lean.layer_types[0]]
        flat = torch.cat([hidden[0] for _, _, hidden, _ in riding] + [hidden[0] for _, hidden in rows]).unsqueeze(1)
        owners = [entry.cache for _, entry, _, _ in riding] + \
            [cache for cache, (_, hidden) in zip(caches, rows) for _ in range(hidden.shape[1])]
        try:
            out = lean.final_norm(lean.fused.run(flat, cos, sin, owners, pasts, kernel_threads()))
        except Exception:
            for _, entry, _, past in riding:
                crop_cache(entry.cache, past)  # layers the call reached hold the step
            raise
        ends = list(itertools.accumulate((hidden.shape[1] for _, hidden in rows), initial=len(riding)))[1:]
        # (with decode rows, theirs and the prompts' last positions in one product; prompts alone: each its own)
        logits = _logits_at_once(shard, out[list(range(len(riding))) + [end - 1 for end in ends]]) if riding else None
        for position, (index, entry, _, past) in enumerate(riding):
            entry.cache.length = past + 1
            results[index] = _decoded(shard, decodes[index - len(steps)], entry, past, out[position : position + 1],
                                      None if logits is None else logits[position : position + 1])
        at = len(riding)
        for number, (cache, (index, hidden)) in enumerate(zip(caches, rows)):
            step, count = steps[index], hidden.shape[1]
            cache.length = count
            try:
                shard.sessions.store(step.session_id, cache, count, shard.start, nbytes=cache_nbytes(cache))
                history = step.history or (list(step.token_ids) if step.token_ids is not None else ())
                mine = None if logits is None else logits[len(riding) + number : len(riding) + number + 1]
                results[index] = shard.finish(out[at : at + count].view(1, count, -1), 0, step.sampling, history,
                                              step.generated_from, logits=mine)
            except Exception as exc:  # (a cache budget exceeded, a grammar that does not compile): this one only
                results[index] = exc
            at += count
    return results  # type: ignore[return-value]
