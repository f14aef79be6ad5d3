"""Sessions that outlive one answer: a conversation's channel, and the head's pool of warm ones.

A `Conversation` is a session id whose channel (route, link, the caches of every hop)
stays open between answers while something holds it: a `/ws/chat` socket (until the
socket closes or the client sends `reset`), or the `WarmPool` of the HTTP API (until its
TTL, its bound or shutdown). The next answer prefills only the prompt's tokens after the
longest prefix it shares with what the caches hold; every hop cuts its cache back to that
length first. The cache still lives exactly as long as its channel: whoever holds a
conversation ends it, and ending it closes the channel, which releases every hop's cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

MIN_REUSE = 16  # shared tokens below which a warm session is not worth adopting (the pool)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


@dataclass(eq=False)
class Conversation:
    """A session kept open between answers, and the token ids its caches hold."""

    sid: str = field(default_factory=lambda: uuid.uuid4().hex)
    path: Any = None  # the open `RoutedPath` while warm; None before the first answer and after a failure
    held: list[int] = field(default_factory=list)  # token ids every hop's cache holds, from position 0
    steps: int = 0  # step numbers go on across answers: a late reply to an old step is never taken for a new one
    last_used: float = field(default_factory=time.monotonic)
    owner: str = ""  # the warm pool's: only requests of the same owner may adopt it

    def renew(self) -> None:
        """The session ended: the next answer opens another, under a new id (no late reply can reach it)."""
        self.sid, self.steps, self.path, self.held = uuid.uuid4().hex, 0, None, []

    @property
    def warm(self) -> bool:
        return self.path is not None

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """Positions the next answer may keep: the shared prefix, less one (the last prompt token runs again)."""
        if not self.warm:
            return 0
        return min(common_prefix(self.held, prompt_ids), len(prompt_ids) - 1)


End = Callable[[Conversation], Awaitable[None]]


class WarmPool:
    """Finished HTTP generations' sessions, kept for the next request that shares their prefix.

    Bounded (`size`, least recently used leaves first) and timed (`ttl` seconds idle). A
    warm session is adopted by one request at a time, and only by a request of the same
    owner (client address and `user`); a concurrent request with the same prefix
    prefills normally, and its own session joins the pool when it ends.
    """

    def __init__(self, size: int, ttl: float, end: End, min_tokens: int = MIN_REUSE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.ttl = ttl
        self.min_tokens = min_tokens
        self._end = end  # closes a conversation's channel
        self._clock = clock
        self._idle: list[Conversation] = []  # least recently used first
        self.evictions: dict[str, int] = {"ttl": 0, "lru": 0, "shutdown": 0}

    def __len__(self) -> int:
        return sum(conversation.warm for conversation in self._idle)  # (one ended elsewhere waits for a sweep)

    def adopt(self, prompt_ids: Sequence[int], owner: str = "") -> Conversation | None:
        """`owner`'s warm conversation sharing the longest prefix with `prompt_ids`, taken out of the pool."""
        best, shared, now = None, 0, self._clock()
        for conversation in self._idle:
            if conversation.owner != owner or now - conversation.last_used > self.ttl:
                continue
            length = conversation.reusable(prompt_ids)
            if length > shared:
                best, shared = conversation, length
        if best is None or shared < self.min_tokens:
            return None
        self._idle.remove(best)
        return best

    async def put(self, conversation: Conversation) -> None:
        """An answer ended: keep its session if it is still warm; then respect the bounds."""
        if conversation.warm:
            conversation.last_used = self._clock()
            self._idle.append(conversation)
        await self.sweep()

    async def sweep(self) -> None:
        """End sessions idle beyond the TTL, then the least recently used beyond the bound."""
        now = self._clock()
        self._idle = [c for c in self._idle if c.warm]  # ended elsewhere (the head's bound on kept sessions)
        for conversation in [c for c in self._idle if now - c.last_used > self.ttl]:
            await self._evict(conversation, "ttl")
        while len(self._idle) > self.size:  # (`_idle` shrinks before each await: no sweep sees it twice)
            await self._evict(self._idle[0], "lru")

    async def clear(self) -> None:
        for conversation in list(self._idle):
            await self._evict(conversation, "shutdown")

    async def _evict(self, conversation: Conversation, reason: str) -> None:
        if conversation not in self._idle:  # adopted, or evicted by a sweep running meanwhile
            return
        self._idle.remove(conversation)
        self.evictions[reason] += 1
        await self._end(conversation)
