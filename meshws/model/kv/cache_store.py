"""Per-session KV caches held by one shard: TTL, LRU, a session cap and a byte budget.

The store knows nothing of torch: a cache is an opaque object and its size in
bytes is told by the caller. Closing a session channel drops its entry; TTL,
LRU and the byte budget are the backstop when a close never arrives.

A cache that has a `release` method (`kv_blocks.LeanCache`, whose blocks other sessions may
share) is told when the store lets it go, whatever the reason. An entry's `nbytes` is all its
cache holds; with caches that share memory, `footprint` (given) counts what they hold together,
each shared part once, for the totals and the byte budget.

A session named `private` (a speed probe's: a few positions, for a moment) is held
like any other but is not one of the node's sessions: it is not counted, its bytes
are not, and storing it never evicts a session of a user.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class KVCacheMiss(Exception):
    """The session's cache is gone or does not match the step asked for."""


class CacheBudgetExceeded(Exception):
    """One session alone needs more cache bytes than the store may hold."""


@dataclass
class CacheEntry:
    cache: Any
    seq_len: int  # tokens the cache holds
    effective_start: int  # first layer this cache was built from
    last_used: float
    nbytes: int = 0


class SessionCacheStore:
    def __init__(
        self,
        max_sessions: int = 64,
        ttl_seconds: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = None,
        measure: Callable[[Any], int] | None = None,
        emptied: Callable[[], None] | None = None,
        footprint: Callable[[list[Any]], int] | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self._measure = measure  # a cache's positions, read from the cache itself
        self._emptied = emptied  # called (lock released, caches freed) when a change leaves no session here
        self._footprint = footprint  # bytes several caches hold together (shared memory counted once)
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._private: set[str] = set()  # ids of entries that are no user's session (see the module's note)
        self._kept: dict[str, str] = {}  # counted apart: ids of shared prompt prefixes ("prefix") and of copies
        # kept for another node's session ("standby", `kv_copies`)
        self._lock = threading.Lock()
        self.evictions = 0  # entries removed by TTL, LRU or the byte budget

    def __len__(self) -> int:
        with self._changing():
            self._expire(self._clock())
            return self._public()

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._entries

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def session_ids(self) -> list[str]:
        with self._lock:
            return [sid for sid in self._entries if sid not in self._private]

    def keep_apart(self, session_id: str, kind: str = "prefix") -> None:
        """`session_id` holds a prompt prefix kept for others to fork, or (`standby`) a copy of a session another
        node serves: not counted among the sessions (`prefixes`, `standbys`), its bytes are, and the budget may evict
        it like any other."""
        with self._lock:
            self._kept[session_id] = kind

    def adopt(self, session_id: str) -> bool:
        """A standby copy becomes a session of this node (a head resumed it here); whether there was one."""
        with self._lock:
            return self._kept.pop(session_id, None) == "standby" and session_id in self._entries

    def apart(self, kind: str) -> int:
        with self._lock:
            return sum(1 for sid, its in self._kept.items() if its == kind and sid in self._entries)

    @property
    def prefixes(self) -> int:
        return self.apart("prefix")

    @contextmanager
    def private(self, session_id: str) -> Iterator[None]:
        """While the block runs, `session_id` is no user's session (a probe's); its entry is dropped after."""
        with self._lock:
            self._private.add(session_id)
        try:
            yield
        finally:
            with self._lock:
                self._remove(session_id)
                self._private.discard(session_id)

    def peek(self, session_id: str) -> CacheEntry | None:
        """The session's entry as it is (neither made recent nor checked), or None."""
        with self._lock:
            return self._entries.get(session_id)

    def held(self, session_id: str) -> int:
        """Positions the session's cache holds (0 without one): measured on the cache when the store can."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return 0
            return self._measure(entry.cache) if self._measure is not None else entry.seq_len

    def store(
        self,
        session_id: str,
        cache: Any,
        seq_len: int,
        effective_start: int,
        nbytes: int = 0,
    ) -> CacheEntry:
        """Put (or replace) a session's cache; evicts others to respect the limits."""
        now = self._clock()
        with self._changing():
            old = self._entries.pop(session_id, None)
            if old is not None and old.cache is not cache:
                _release(old.cache)
            self._check_fits(session_id, nbytes)
            entry = CacheEntry(cache, seq_len, effective_start, now, nbytes)
            self._entries[session_id] = entry
            self._expire(now)
            self._enforce_limits(keep=session_id)
            return entry

    def lookup(
        self,
        session_id: str,
        expected_seq_len: int | None = None,
        effective_start: int | None = None,
        longer_ok: bool = False,
    ) -> CacheEntry:
        """The session's entry, made most recent; a stale or mismatched entry is dropped.

        With `longer_ok`, an entry holding more than `expected_seq_len` positions is
        returned as it is: the caller cuts it back.
        """
        now = self._clock()
        with self._changing():
            self._expire(now)
            entry = self._entries.get(session_id)
            if entry is None:
                raise KVCacheMiss(f"no cache for session {session_id}")
            if expected_seq_len is not None and entry.seq_len != expected_seq_len \
                    and not (longer_ok and entry.seq_len > expected_seq_len):
                self._remove(session_id)
                raise KVCacheMiss(
                    f"session {session_id} holds {entry.seq_len} tokens, step expects {expected_seq_len}"
                )
            if effective_start is not None and entry.effective_start != effective_start:
                self._remove(session_id)
                raise KVCacheMiss(
                    f"session {session_id} starts at layer {entry.effective_start}, step expects {effective_start}"
                )
            entry.last_used = now
            self._entries.move_to_end(session_id)
            return entry

    def resize(self, session_id: str, nbytes: int) -> None:
        """Record a session's new cache size (it grows each decode step)."""
        with self._changing():
            entry = self._entries.get(session_id)
            if entry is None:
                return
            self._check_fits(session_id, nbytes, drop=True)
            entry.nbytes = nbytes
            self._enforce_limits(keep=session_id)

    def drop(self, session_id: str) -> bool:
        with self._changing():
            self._kept.pop(session_id, None)
            return self._remove(session_id)

    def clear(self) -> int:
        with self._changing():
            count = len(self._entries)
            for sid in list(self._entries):
                self._remove(sid)
            self._kept.clear()
            return count

    def purge_expired(self) -> int:
        with self._changing():
            before = len(self._entries)
            self._expire(self._clock())
            return before - len(self._entries)

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock, held for a change that may remove entries (a release, an expiry, a mismatch, the budget); if
        the change left the store empty, `emptied` is called once the lock is released (the caches freed)."""
        emptied = False
        try:
            with self._lock:
                had, kept = self._public(), self._kept.keys() & self._entries.keys()
                try:
                    yield
                finally:  # (users' last session went, or a kept prefix went while no user's is here)
                    emptied = not self._public() and (had > 0 or bool(kept - self._entries.keys()))
        finally:
            if emptied and self._emptied is not None:
                self._emptied()

    # -- internals (lock held) -------------------------------------------

    def _remove(self, session_id: str) -> bool:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            _release(entry.cache)
            self._kept.pop(session_id, None)
        return entry is not None

    def _bytes(self) -> int:
        caches = [entry for sid, entry in self._entries.items() if sid not in self._private]
        most = sum(entry.nbytes for entry in caches)  # (shared memory counted in each: a bound, and cheap)
        if self._footprint is None or not most:
            return most
        return self._footprint([entry.cache for entry in caches])

    def _public(self) -> int:
        apart = self._private | self._kept.keys()
        return len(self._entries) - sum(1 for sid in apart if sid in self._entries)

    def _check_fits(self, session_id: str, nbytes: int, drop: bool = False) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            if drop:
                self._remove(session_id)
            raise CacheBudgetExceeded(
                f"session {session_id} needs {nbytes} cache bytes, the budget is {self.max_bytes}"
            )

    def _expire(self, now: float) -> None:
        stale = [sid for sid, e in self._entries.items() if now - e.last_used > self.ttl_seconds]
        for sid in stale:
            self._remove(sid)
        self.evictions += len(stale)

    def _enforce_limits(self, keep: str) -> None:
        def over_bytes() -> bool:
            if self.max_bytes is None:
                return False
            if sum(e.nbytes for sid, e in self._entries.items() if sid not in self._private) <= self.max_bytes:
                return False  # (within the budget even counting shared blocks in every cache: the usual case)
            return self._bytes() > self.max_bytes

        # (a private entry counts toward neither limit and is never the victim; a kept prefix counts toward the
        # bytes only, so only the bytes may take it)
        while (count := self._public() > self.max_sessions) or over_bytes():
            apart = self._private | (self._kept.keys() if count else set())
            copies = () if count else (sid for sid, kind in self._kept.items() if kind == "standby" and sid != keep)
            victim = next(iter(copies), None) or next((s for s in self._entries if s != keep and s not in apart), None)
            if victim is None:
                break
            if self._kept.get(keep) == "standby" and self._kept.get(victim) != "standby":  # (never a user's for it)
                self._remove(keep)
                raise CacheBudgetExceeded(f"no room for a standby copy of {keep} but a session's")
            self._remove(victim)
            self.evictions += 1


def _release(cache: Any) -> None:
    release = getattr(cache, "release", None)
    if release is not None:
        release()
