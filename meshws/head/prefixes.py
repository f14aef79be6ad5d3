"""Prompt prefixes shared by every request that begins with them, computed once and kept on every shard.

A `SharedPrefix` is a session of its own, kept open by the head like a conversation: its caches
hold a prompt's whole blocks of `PREFIX_BLOCK` tokens. A new session starts as a fork of
the kept prefix whose tokens agree with its prompt's for the most whole blocks (compared token by
token, never by a hash), at that many tokens: every shard of the prefix's route starts the new cache on the
prefix's blocks (shared, counted once, copied only from where the two differ) and only the rest
of the prompt is prefilled; `cached_tokens` says how much was not. A prompt that shares no block
with any kept prefix, or whose whole blocks go two or more beyond what one shares with it (a
conversation's next turn, not another question after the same system prompt), has them built
first as a prefix of its own (from that one), which it then forks as any later request does.

Prefixes serve requests of the same `key` only (the request's `cache_salt`; "" for all others):
whether a prefix was kept, and so `cached_tokens` and the time to the first token, tells a client
what another sent first. Bounded (`size`, least recently used out first) and timed (`ttl`); the
shards' byte budgets may drop one sooner, and a request forking a prefix gone from a shard gets a
cache miss there and prefills in full, which ends the prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from contextlib import aclosing

from ..mesh.aio import run_uncancelled, waited
from .conversation import Conversation, common_prefix
from .stats import Fork, GenerationRequest, GenerationStats

log = logging.getLogger("meshws.prefixes")

BUILD_WAIT = 60.0  # seconds a request waits for a prefix another one is building before it prefills in full
PREFIX_BLOCK = 64  # tokens are shared in whole blocks of this many (a kept prefix's, and a fork's)
MAX_BUILDS = 2  # prefixes built at once (beyond, a request forks what is kept, or prefills in full)

Build = Callable[[list[int], Fork | None], Awaitable[Conversation | None]]  # tokens, from -> the kept session
End = Callable[[Conversation], Awaitable[None]]


@dataclass(eq=False)
class SharedPrefix:
    key: str
    tokens: list[int]
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    session: Conversation | None = None  # once built; None after a failed build
    last_used: float = field(default_factory=time.monotonic)
    users: int = 0  # requests that forked it
    waiting: int = 0  # requests waiting for its build
    build: asyncio.Task | None = None  # while it is built

    @property
    def live(self) -> bool:
        return not self.ready.is_set() or (self.session is not None and self.session.warm)


class PrefixPool:
    def __init__(self, size: int, build: Build, end: End, ttl: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.ttl = ttl
        self._build = build  # prefills a prefix as a kept session (`Generator.hold_prefix`)
        self._end = end  # closes a kept session on every shard
        self._clock = clock
        self._entries: list[SharedPrefix] = []  # least recently used first
        self._builds: set[asyncio.Task] = set()  # (held: the loop keeps only a weak reference to a task)
        self.hits = self.built = self.evictions = 0

    def __len__(self) -> int:
        return sum(1 for entry in self._entries if entry.ready.is_set() and entry.live)

    async def fork_for(self, prompt_ids: Sequence[int], key: str) -> tuple[Fork, int] | None:
        """Where a new session with this prompt starts: the kept prefix sharing the most whole blocks with it, forked
        at that many tokens; or, where the prompt's whole blocks go beyond that, a prefix of them built now (from
        that one) and forked whole. Also the tokens this request had computed for it (a build it started). None:
        no pool, or nothing worth sharing."""
        if not self.size:
            return None
        await self.sweep()
        entry, shared = self._best(prompt_ids, key, building=True)
        if entry is not None and not entry.ready.is_set():  # another request builds what this one needs: wait
            if not await self._wait(entry, BUILD_WAIT):
                return None
        entry, shared = self._best(prompt_ids, key)
        length, computed = (len(prompt_ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK, 0
        if length > shared and (not shared or length - shared >= 2 * PREFIX_BLOCK) and len(self._builds) < MAX_BUILDS:
            computed = length - shared
            entry, shared = self._start(list(prompt_ids[:length]), key, entry, shared), length
            if not await self._wait(entry, None):  # (its own prompt's prefill: as long as that takes)
                return None
        session = entry.session if entry is not None and shared else None
        if session is None or not session.warm or not _reachable(session):
            return None
        entry.last_used = session.last_used = self._clock()  # (the head's bound on kept sessions reads the latter)
        if entry in self._entries:  # (the most recent now; a sweep meanwhile may have taken it out)
            self._entries.remove(entry)
            self._entries.append(entry)
        self.hits += not computed
        return Fork(session.sid, shared), computed

    async def spoiled(self, fork: Fork) -> None:
        """A session forked from this prefix found it missing somewhere (evicted by a shard's budget): it goes."""
        for entry in list(self._entries):
            if entry.session is not None and entry.session.sid == fork.sid:
                await self._evict(entry)

    async def clear(self) -> None:
        for task in list(self._builds):  # (builds first: one ending after this would keep its session)
            task.cancel()
        await asyncio.gather(*self._builds, return_exceptions=True)
        for entry in list(self._entries):
            await self._evict(entry)

    def describe(self) -> dict[str, Any]:
        return {"kept": len(self), "limit": self.size, "hits": self.hits, "built": self.built,
                "evictions": self.evictions}

    # -- internals -----------------------------------------------------------

    def _best(self, prompt_ids: Sequence[int], key: str, building: bool = False) -> tuple[SharedPrefix | None, int]:
        """The prefix of `key` (built, or with `building` also being built) sharing the most whole blocks of leading
        tokens with the prompt (its last token apart), and how many tokens that is. Only whole blocks are shared:
        a client learns whether another sent the same 64 tokens, never one token at a time."""
        best, shared = None, 0
        for entry in self._entries:
            if entry.key == key and entry.live and (building or entry.ready.is_set()):
                count = min(common_prefix(entry.tokens, prompt_ids), len(prompt_ids) - 1)
                count = count // PREFIX_BLOCK * PREFIX_BLOCK
                if count > shared:
                    best, shared = entry, count
        return best, shared

    async def _wait(self, entry: SharedPrefix, timeout: float | None) -> bool:
        """Wait for `entry`'s build (`timeout` seconds at most): has it ended? A build nobody waits for any more (its
        requesters hung up, or gave up and prefill in full) is cancelled: a head whose clients left goes idle."""
        entry.waiting += 1
        try:
            return await waited(entry.ready, timeout)
        finally:
            entry.waiting -= 1
            if not entry.waiting and not entry.ready.is_set() and entry.build is not None:
                entry.build.cancel()

    def _start(self, tokens: list[int], key: str, base: SharedPrefix | None, shared: int) -> SharedPrefix:
        """A new prefix of `tokens`, built in the background from `base`'s first `shared` tokens, if given, for as
        long as a request waits for it (`_wait`)."""
        entry = SharedPrefix(key, tokens, last_used=self._clock())
        self._entries.append(entry)

        async def build() -> None:
            fork = None
            if base is not None and base.session is not None and base.session.warm:
                fork = Fork(base.session.sid, shared)
            try:
                entry.session = await self._build(tokens, fork)
            except Exception as exc:  # (the requests waiting for it prefill in full)
                log.info("a shared prefix of %d tokens could not be built (%s)", len(tokens), exc)
            finally:  # (cancelled too: its session was closed everywhere on the way out)
                entry.ready.set()
                entry.build = None
                if entry.session is None:
                    self._drop(entry)
            self.built += entry.session is not None
            entry.last_used = self._clock()  # (the newest: its requests fork it before any sweep ends it)
            if entry in self._entries:
                self._entries.remove(entry)
                self._entries.append(entry)

        task = entry.build = asyncio.get_running_loop().create_task(build())
        self._builds.add(task)
        task.add_done_callback(self._builds.discard)
        return entry

    async def sweep(self) -> None:
        """Drop prefixes whose session ended elsewhere, then end those idle past the TTL, then the oldest beyond
        the bound (those still building are left to finish)."""
        now = self._clock()
        for entry in [e for e in self._entries if not e.live]:
            self._drop(entry)
        for entry in [e for e in self._entries if e.ready.is_set() and now - e.last_used > self.ttl]:
            await self._evict(entry)
        while len(self._entries) > self.size:
            oldest = next((e for e in self._entries if e.ready.is_set()), None)
            if oldest is None:
                break
            await self._evict(oldest)

    def _drop(self, entry: SharedPrefix) -> None:
        if entry in self._entries:
            self._entries.remove(entry)

    async def _evict(self, entry: SharedPrefix) -> None:
        if entry not in self._entries:
            return
        self._entries.remove(entry)
        self.evictions += 1
        if entry.session is not None and entry.session.warm:
            await self._end(entry.session)


def _reachable(session: Conversation) -> bool:
    """Is the prefix's first hop up (a new session's `open` goes there before any failover could route around)?"""
    link = getattr(getattr(session.path, "route", None), "link", None)
    return link is None or link.is_up


async def hold_prefix(generator: Any, tokens: list[int], fork: Fork | None) -> Conversation | None:
    """`tokens` prefilled on a route as a session kept open (from `fork`'s, if given): a prefix for others to fork."""
    conversation = Conversation()
    stats = GenerationStats(sid=conversation.sid, internal=True)
    request = GenerationRequest(prompt="", max_tokens=1, prompt_ids=list(tokens), ignore_eos=True)
    try:
        async with aclosing(generator.generate(request, stats, conversation=conversation, fork=fork)) as events:
            async for _ in events:
                pass
    except BaseException:  # (cancelled as the answer was kept: the session must not outlive its build)
        if conversation.warm:
            await run_uncancelled(generator.end(conversation))
        raise
    if conversation.warm and conversation.held == list(tokens):
        return conversation
    if conversation.warm:
        await generator.end(conversation)
    return None
