"""Running a shard's layers for a session: against its KV cache, or stateless when caching cannot work.

The cached path is the normal one: a prefill starts the session's cache, a decode
step (or a chunk) extends it at `past_len`. The seed's fallback is kept here, apart
from it: if the cached path itself fails (a kernel that cannot run on this hardware,
the seed's Triton-on-CPU case), caching is turned off for this shard, a prefill is
retried stateless, and a decode step — which cannot be redone without its cache —
answers a cache miss so the head re-prefills.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .cache_store import KVCacheMiss, SessionCacheStore
from .tensors import cache_nbytes

log = logging.getLogger("meshws.shard")

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
            entry = self.sessions.lookup(session_id, expected_seq_len=past_len, effective_start=self.start)
            cache = entry.cache
        try:
            output = self._run(hidden, positions, cache)
        except Exception as exc:
            self._disable(exc)
            return self._stateless_instead(hidden, positions, mode, exc)
        seq_len = past_len + hidden.shape[1]
        if entry is None:
            self.sessions.store(session_id, cache, seq_len, self.start, nbytes=cache_nbytes(cache))
        else:
            entry.seq_len = seq_len
            self.sessions.resize(session_id, cache_nbytes(cache))
        return output

    # -- the fallback ------------------------------------------------------------

    def _stateless_instead(self, hidden: torch.Tensor, positions: torch.Tensor, mode: str,
                           cause: Exception | None = None) -> torch.Tensor:
        if mode == "decode":
            detail = f"cached step failed ({cause}); " if cause else ""
            raise KVCacheMiss(f"{detail}caching is off on this shard; re-prefill")
        return self._run(hidden, positions, None)

    def _disable(self, exc: Exception) -> None:
        if self.supports_kv_cache:
            log.warning("%s: the cached path failed (%s); serving stateless from now on", self.label, exc)
        self.supports_kv_cache = False
        self.sessions.clear()
