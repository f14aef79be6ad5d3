"""A session's keys and values as bytes, for a standby: another node of the same layers (`mesh.standby`).

`export_rows` reads the positions a standby lacks from a session's `LeanCache`, as stored (float32, bfloat16, or
q8_0's blocks: nothing converted); `import_rows` writes them into the standby's copy of that session, which the
store counts apart from users' sessions (`keep_apart(..., "standby")`) until a head resumes the session there.
Rows travel as `[layers, 2, kv_heads, positions, width]`: each layer's keys, then its values.

A cache cut back (rejected drafts, a conversation's new turn) is sent again from where it was cut: the cache says
how far it is unchanged since its last export (`changed_from`), and a copy whose cache is new starts at 0.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend import KVRows
from .cache_store import KVCacheMiss
from .kv_blocks import KV_Q8_0, LeanCache
from ..tensors import cache_nbytes

STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "q8_0": torch.uint8}


def kind_of(cache: LeanCache) -> str:
    return "q8_0" if cache.dtype == KV_Q8_0 else {torch.float32: "float32", torch.bfloat16: "bfloat16"}[cache.dtype]


def export_rows(shard: Any, session_id: str, sent: int, most: int, most_bytes: int) -> KVRows | None:
    """Up to `most` positions (`most_bytes` bytes, one position at least) of the session's cache a standby that holds
    `sent` lacks (from where the cache last changed, if earlier): None without a cache of blocks; no positions when
    the standby has them all."""
    try:
        cache = shard.sessions.lookup(session_id).cache
    except KVCacheMiss:
        return None
    if not isinstance(cache, LeanCache) or cache.released:
        return None
    start = min(sent, cache.changed_from, cache.length)
    per_position = cache.layers * 2 * cache.shape[0] * cache.width * STORAGE[kind_of(cache)].itemsize
    end = min(cache.length, start + max(1, min(most, most_bytes // per_position)))
    rows = cache.rows(start, end).contiguous()
    cache.changed_from = end
    return KVRows(start, kind_of(cache), tuple(rows.shape), rows.view(torch.uint8).numpy().tobytes())


def import_rows(shard: Any, session_id: str, rows: KVRows) -> int:
    """Write `rows` into this node's copy of the session (a new copy if it has none and they start at 0); the
    positions the copy holds after. A copy that lacks positions before `rows.start` keeps what it has: the
    sender starts again from there. ValueError when the rows do not fit this node's caches."""
    lean = getattr(shard, "lean", None)
    if lean is None or not shard.supports_kv_cache:
        raise ValueError("this node keeps no standby copies (its layers run without a lean cache)")
    template = lean.new_cache()
    want = (template.layers, 2, template.shape[0], rows.count, template.width)
    if rows.dtype != kind_of(template) or tuple(rows.shape) != want:
        raise ValueError(f"standby rows {rows.dtype} {list(rows.shape)} do not fit this node's caches "
                         f"({kind_of(template)} {list(want)})")
    if len(rows.body) != rows.count * want[0] * 2 * want[2] * want[4] * STORAGE[rows.dtype].itemsize:
        raise ValueError(f"standby rows of {len(rows.body)} bytes do not fill their shape {list(rows.shape)}")
    if rows.start + rows.count > shard.context_length:
        raise ValueError(f"standby rows end at {rows.start + rows.count}, beyond the context {shard.context_length}")
    tensor = torch.frombuffer(bytearray(rows.body), dtype=STORAGE[rows.dtype]).view(*rows.shape)
    try:
        entry = shard.sessions.lookup(session_id)
    except KVCacheMiss:
        entry = None
    if entry is None or not isinstance(entry.cache, LeanCache):
        if rows.start != 0:
            return 0
        template.put_rows(0, tensor)
        shard.sessions.keep_apart(session_id, "standby")
        try:
            shard.sessions.store(session_id, template, template.length, shard.start, nbytes=cache_nbytes(template))
        except Exception:
            shard.sessions.drop(session_id)  # (not left marked as a copy)
            raise
        return template.length
    cache = entry.cache
    if rows.start > cache.length:
        return cache.length
    cache.put_rows(rows.start, tensor)
    entry.seq_len = cache.length
    shard.sessions.resize(session_id, cache_nbytes(cache))
    return cache.length


class StandbyRows:
    """A shard's side of standbys (`ModelShard` is one): its sessions' rows out, other nodes' sessions' rows in."""

    sessions: Any
    supports_kv_cache: bool

    def export_kv(self, session_id: str, sent: int, most: int, most_bytes: int) -> KVRows | None:
        return export_rows(self, session_id, sent, most, most_bytes) if self.supports_kv_cache else None

    def kv_unchanged(self, session_id: str) -> int:
        """Positions of the session's cache as they were last exported (0 without one)."""
        entry = self.sessions.peek(session_id)
        return int(getattr(entry.cache, "changed_from", 0)) if entry is not None else 0

    def import_kv(self, session_id: str, rows: KVRows) -> int:
        return import_rows(self, session_id, rows)
