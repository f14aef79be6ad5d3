"""Running a shard's layers for a session: against its KV cache, or stateless when caching cannot work.

The cached path is the normal one: a prefill starts the session's cache, a decode
step (or a chunk) extends it at `past_len`. The seed's fallback is kept here, apart
from it: if the cached path itself cannot run here (a kernel missing on this
hardware, the seed's Triton-on-CPU case: `cannot_run_here`), caching is turned off
for this shard, a prefill is retried stateless, and a decode step — which cannot be
redone without its cache — answers a cache miss so the head re-prefills. A prefill
turns caching off only if the same input then runs stateless. Any other failure (a
MemoryError, a bad input) fails that session's step alone: its cache, perhaps half
updated, is dropped, and the shard goes on caching for everyone else.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any, Callable

import torch

from .kv.cache_store import CacheEntry, KVCacheMiss, SessionCacheStore
from .tensors import cache_nbytes, crop_cache

log = logging.getLogger("meshws.shard")

# Words of errors from a kernel or backend that does not exist on this hardware (not of memory or input errors).
_UNSUPPORTED = re.compile(r"triton|kernel|not implemented|not supported|unsupported|compiler|cuda|no backend", re.I)
_MEMORY = re.compile(r"out of memory|can't allocate|cannot allocate|failed to allocate", re.I)


def cannot_run_here(exc: BaseException) -> bool:
    """Is `exc` the class of failure the stateless fallback is for: code that cannot run on this hardware?"""
    if isinstance(exc, MemoryError) or _MEMORY.search(str(exc)):
        return False
    if isinstance(exc, NotImplementedError):
        return True
    return type(exc) is RuntimeError and bool(_UNSUPPORTED.search(str(exc)))


def cut_back(sessions: SessionCacheStore, session_id: str, past_len: int, start: int) -> CacheEntry:
    """The session's cache, holding exactly `past_len` positions for the step that extends it.

    A longer cache is cut back (a conversation whose history diverged after `past_len`,
    rejected drafts); a shorter one, or one that cannot be cut back (a sliding window that
    dropped positions), is a cache miss: the head re-prefills.
    """
    entry = sessions.lookup(session_id, expected_seq_len=past_len, effective_start=start, longer_ok=True)
    if entry.seq_len > past_len:
        try:
            crop_cache(entry.cache, past_len)
        except ValueError as exc:
            sessions.drop(session_id)
            raise KVCacheMiss(f"session {session_id} cannot be cut back to {past_len} positions: {exc}") from None
        entry.seq_len = past_len
        sessions.resize(session_id, cache_nbytes(entry.cache))
    return entry


def fork(sessions: SessionCacheStore, parent_id: str, session_id: str, length: int, start: int) -> bool:
    """`session_id`'s cache becomes a copy of `parent_id`'s first `length` positions; False if it cannot."""
    try:
        entry = sessions.lookup(parent_id, effective_start=start)
    except KVCacheMiss:
        return False
    if entry.seq_len < length:
        return False
    if hasattr(entry.cache, "copy"):  # a lean cache
        cache = entry.cache.copy(length)
    else:
        cache = copy.deepcopy(entry.cache)
        try:
            crop_cache(cache, length)
        except ValueError:  # a sliding window cannot be cut back: no fork, the first step misses
            return False
    sessions.store(session_id, cache, length, start, nbytes=cache_nbytes(cache))
    return True


RunLayers = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # (hidden, positions, cache or None)


class SessionLayers:
    def __init__(self, run: RunLayers, new_cache: Callable[[], Any], sessions: SessionCacheStore, start: int,
                 label: str = "shard") -> None:
        self._run = run
        self._new_cache = new_cache
        self.sessions = sessions
        self.start = start  # the first layer: a cache built elsewhere is not ours
        self.label = label
        self.supports_kv_cache = True

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, session_id: str | None = None,
            mode: str | None = None, past_len: int = 0) -> torch.Tensor:
        """`mode` "prefill" starts the session's cache, "decode" extends it; no session: stateless."""
        if session_id is None or mode is None:
            return self._run(hidden, positions, None)
        if not self.supports_kv_cache:
            return self._stateless_instead(hidden, positions, mode)
        if mode == "prefill":
            cache, entry = self._new_cache(), None
        else:
            entry = cut_back(self.sessions, session_id, past_len, self.start)
            cache = entry.cache
        try:
            output = self._run(hidden, positions, cache)
        except Exception as exc:
            return self._after_failure(exc, hidden, positions, session_id, mode)
        seq_len = past_len + hidden.shape[1]
        if entry is None:
            self.sessions.store(session_id, cache, seq_len, self.start, nbytes=cache_nbytes(cache))
        else:
            entry.seq_len = seq_len
            self.sessions.resize(session_id, cache_nbytes(cache))
        return output

    # -- the fallback ------------------------------------------------------------

    def _after_failure(self, exc: Exception, hidden: torch.Tensor, positions: torch.Tensor, session_id: str,
                       mode: str) -> torch.Tensor:
        """The cached path failed: the seed's fallback if it cannot run here, else this session's step fails."""
        self.sessions.drop(session_id)  # a failed step may have half-updated the cache
        if not cannot_run_here(exc):
            raise exc
        if mode == "decode":
            self._disable(exc)
            return self._stateless_instead(hidden, positions, mode, exc)
        output = self._run(hidden, positions, None)  # raises (caching stays on) if the input is at fault
        self._disable(exc)
        return output

    def _stateless_instead(self, hidden: torch.Tensor, positions: torch.Tensor, mode: str,
                           cause: Exception | None = None) -> torch.Tensor:
        if mode == "decode":
            detail = f"cached step failed ({cause}); " if cause else ""
            raise KVCacheMiss(f"{detail}caching is off on this shard; re-prefill")
        return self._run(hidden, positions, None)

    def _disable(self, exc: BaseException) -> None:
        if self.supports_kv_cache:
            log.warning("%s: the cached path failed (%s); serving stateless from now on", self.label, exc)
        self.supports_kv_cache = False
        self.sessions.clear()
