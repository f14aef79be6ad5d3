"""One wave: nodes that share a host's cores compute in turn, each on all of them.

With groups in flight (`ComputeWorker.micro_batches`) a head computes one group while the tail computes
the other, each on its own core. That is what shards on machines of their own want. Nodes on one host
(the README's two commands) can do better: `cores` lends a node the cores of the nodes not computing at
that moment, and the kernels hand a product's units to whichever thread is free (`native`), so one
whole batch runs on every core, first on the head, then on the tail. Each node then reads its weights
once a round instead of once per group, at twice one core's bandwidth (bf16, 16 sessions, one run each:
365 -> 423 tok/s, p95 gap 48 -> 37 ms).

A head keeps its wave whole: when some sessions' decode steps are back and others are still on later
shards, it waits for those (up to `WAVE_LINGER` after the first of them is back, running other work such
as a joining session's prompt meanwhile), since a burst of new sessions splits a wave and the parts would
never meet again. It waits only for steps on their way (a lone session's never): one whose
result is back (`ComputeWorker.returned`) is not waited for, so a client slow to read its tokens, or an
answer that ended, delays no one else; nor is a step sent longer than `STALE` ago (a lost shard).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

LINGER = 0.003  # seconds a partial batch may wait for steps of other live sessions (never for a lone one)
QUIET = 0.001  # ... a guessed wave no longer than this after the last step came: a group's steps come together
WAVE_LINGER = 0.05  # seconds a head waits at most for the rest of its wave (a later shard's step of it)
STALE = 1.0  # a step sent on this long ago and not back: not waited for


class InFlight:
    """(Under the worker's lock.) Sessions whose decode step this shard sent on, and whose next one has not come."""

    def __init__(self) -> None:
        self._sent: dict[str, float] = {}

    def sent(self, session_ids: Iterable[str], now: float) -> None:
        for session_id in session_ids:
            self._sent[session_id] = now

    def back(self, session_id: str | None) -> None:
        """Its next step came (or its answer ended, or it was released)."""
        if session_id is not None:
            self._sent.pop(session_id, None)

    def waiting(self, now: float) -> int:
        """Sessions still on later shards, stale ones forgotten."""
        for session_id in [sid for sid, when in self._sent.items() if now - when > STALE]:
            del self._sent[session_id]
        return len(self._sent)


class Waves:
    """Which decode steps a `ComputeWorker` batch takes, and how long it waits for them (lock held throughout)."""

    max_batch: int
    lingers: int
    live_sessions: Callable[[], int]
    micro_batches: Callable[[], int]
    whole_wave: Callable[[], bool]
    _decodes: deque[Any]  # (jobs with `step` and `queued`, the time they came)
    _urgent: deque[Any]
    _others: deque[Any]
    _ready: threading.Condition
    _closed: bool
    _arrived: float
    _in_flight: InFlight

    def _group_size(self) -> tuple[int, bool]:
        """How many decode steps a batch waits for (the live sessions split into `micro_batches` groups),
        and whether they are split at all."""
        try:
            live, groups = max(1, int(self.live_sessions())), max(1, int(self.micro_batches()))
        except Exception:  # a hint, never a reason to fail
            live, groups = 1, 1
        return max(1, min(self.max_batch, -(-live // groups))), groups > 1

    def _take(self, group: int, split: bool) -> list[Any]:
        """(Lock held.) The decode steps a batch takes off the queue: one group's, or (not split) every one waiting."""
        return [self._decodes.popleft() for _ in range(min(group if split else self.max_batch, len(self._decodes)))]

    def _wave(self, live: int) -> tuple[int, bool, bool]:
        """(Lock held; a shard that does not split the sessions itself.) The steps to wait for: the wave the
        previous shard announced (`DecodeStep.group`: the size of the batch it computed them in; True last),
        else every live session, a guess (True second)."""
        announced = max((job.step.group for job in self._decodes if job.step is not None), default=1)
        return (min(live, announced), False, True) if announced > 1 else (live, True, False)

    def _wave_kept(self) -> bool:
        try:
            return bool(self.whole_wave())
        except Exception:  # a hint, never a reason to fail
            return False

    def _hold_wave(self) -> None:
        """(Lock held; `whole_wave`.) Wait while sessions of this wave are still on later shards (`waves`), up to
        WAVE_LINGER after its first step came back; and not while other work waits (`_wave_out`: it runs then)."""
        deadline, counted = self._wave_deadline(), False
        while not (self._closed or self._urgent or self._others) and len(self._decodes) < self.max_batch \
                and self._in_flight.waiting(time.monotonic()) and time.monotonic() < deadline:
            self.lingers, counted = self.lingers + (not counted), True
            self._ready.wait(deadline - time.monotonic())

    def _wave_out(self) -> bool:
        """(Lock held.) Is a kept wave still partly on later shards, with room for the rest of it? (Meanwhile this shard
        may do other work, such as a joining session's prompt: it would otherwise idle.)"""
        now = time.monotonic()
        return self._wave_kept() and len(self._decodes) < self.max_batch and now < self._wave_deadline() \
            and bool(self._in_flight.waiting(now))

    def _wave_deadline(self) -> float:
        """(Lock held.) How long the part of a wave that is back waits for the rest: WAVE_LINGER after the first
        of it came, however much other work ran meanwhile."""
        return (self._decodes[0].queued if self._decodes else time.monotonic()) + WAVE_LINGER

    def _linger(self, expected: int, guessed: bool = False, announced: bool = False) -> None:
        """(Lock held.) Wait briefly while more live sessions may still add their steps (up to `expected`); a
        guessed count only as long as steps keep arriving: with groups in flight (`micro_batches`) a later shard
        gets one group at a time, and the live sessions of other groups will not come now. An announced wave
        (`_wave`) is waited for while its steps keep coming, up to WAVE_LINGER."""
        if len(self._decodes) >= expected or self._closed:
            return
        self.lingers += 1
        started = time.monotonic()
        deadline, cap = started + LINGER, started + WAVE_LINGER
        while len(self._decodes) < expected and not self._closed:
            # a guessed wave while steps come close together; an announced one while they keep coming at all (the
            # previous shard's event loop sends a large wave's frames one by one: 31 took longer than LINGER)
            until = min(deadline, self._arrived + QUIET) if guessed else \
                max(deadline, min(self._arrived + LINGER, cap)) if announced else deadline
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            self._ready.wait(remaining)
