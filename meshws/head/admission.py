"""Admission: how many generations a head runs at once, and the FIFO queue of those waiting.

A request takes a `Slot` before any work is spent on it (tokenizing included). Beyond
`slots` running, requests wait in arrival order, up to `max_queue` of them and for at
most `timeout` seconds; only a full queue, a timeout or a draining head refuses
(`Refused`, with the seconds a client should wait before trying again). A waiter whose
caller is cancelled (its client hung up) leaves the queue at once. A slot is held until
`Slot.release()`, which the generation calls only after its session's release has run,
so a head never looks idle while it still works for a departed client.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable


class Refused(Exception):
    """No slot: the queue is full, the wait timed out, or the head is draining."""

    def __init__(self, message: str, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code  # queue_full | queue_timeout | shutting_down
        self.retry_after = retry_after


class Slot:
    """One running generation's place; `release()` is idempotent."""

    def __init__(self, queue: "AdmissionQueue", task: asyncio.Task | None) -> None:
        self._queue: AdmissionQueue | None = queue
        self.task = task  # the task that holds it (cancelled when a drain runs out of time)

    @property
    def held(self) -> bool:
        return self._queue is not None

    def release(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            queue._hand_on(self)


class AdmissionQueue:
    def __init__(self, slots: int, max_queue: int, timeout: float,
                 on_wait: Callable[[float], None] = lambda seconds: None,
                 on_refuse: Callable[[str], None] = lambda code: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = max(1, slots)
        self.max_queue = max(0, max_queue)
        self.timeout = timeout
        self.on_wait = on_wait  # seconds an admitted request waited (0 when a slot was free)
        self.on_refuse = on_refuse  # the code of each refusal
        self.draining = False
        self._clock = clock
        self._held: set[Slot] = set()
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._since: dict[asyncio.Future[Slot], float] = {}  # when each waiter joined the queue

    @property
    def running(self) -> int:
        """Slots held now: generations running, or still releasing their sessions."""
        return len(self._held)

    @property
    def waiting(self) -> int:
        """Requests in the queue now."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def longest_wait(self) -> float:
        """Seconds the longest-waiting request has waited so far (0 with nobody waiting)."""
        now = self._clock()
        return max((now - since for waiter, since in self._since.items() if not waiter.done()), default=0.0)

    async def enter(self) -> Slot:
        """A slot, at once or after waiting in line; `Refused` when there is none to have."""
        if self.draining:
            raise self._refuse("the head is shutting down; retry on another head", "shutting_down", 5)
        if len(self._held) < self.slots and not self.waiting:
            return self._take(0.0)
        if self.waiting >= self.max_queue:
            raise self._refuse(f"the head is running {len(self._held)} generations and {self.waiting} more wait, "
                               "its limits; retry shortly", "queue_full", 1 + self.waiting // self.slots)
        started = self._clock()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Slot] = loop.create_future()
        self._waiters.append(waiter)
        self._since[waiter] = started
        timer = loop.call_later(self.timeout, self._expire, waiter)
        try:
            slot = await waiter  # not wait_for: it would swallow a cancellation that comes with a slot
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                waiter.result().release()  # handed a slot just as the caller went: pass it on
            waiter.cancel()
            self._forget(waiter)
            raise
        finally:
            timer.cancel()
            self._since.pop(waiter, None)
        slot.task = asyncio.current_task()
        self.on_wait(self._clock() - started)
        return slot

    def take_now(self, count: int) -> list[Slot] | None:
        """`count` more slots at once (another request's choices), or None if they are not free now."""
        if self.draining or self.waiting or len(self._held) + count > self.slots:
            return None
        return [self._take(0.0) for _ in range(count)]

    def drain(self) -> None:
        """Take no more requests: everyone still waiting is refused."""
        self.draining = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self._refuse("the head is shutting down; retry on another head",
                                                  "shutting_down", 5))

    def cancel_running(self) -> int:
        """Cancel the tasks of every held slot (a drain's grace ran out); how many."""
        tasks = {slot.task for slot in self._held if slot.task is not None and not slot.task.done()}
        for task in tasks:
            task.cancel()
        return len(tasks)

    def _take(self, waited: float) -> Slot:
        slot = Slot(self, asyncio.current_task())
        self._held.add(slot)
        self.on_wait(waited)
        return slot

    def _hand_on(self, slot: Slot) -> None:
        """`slot` was released: the first one still waiting gets a new slot in its place."""
        self._held.discard(slot)
        while self._waiters and len(self._held) < self.slots:
            waiter = self._waiters.popleft()
            if not waiter.done():
                successor = Slot(self, None)
                self._held.add(successor)
                waiter.set_result(successor)

    def _expire(self, waiter: asyncio.Future[Slot]) -> None:
        if not waiter.done():
            waiter.set_exception(self._refuse(f"waited {self.timeout:g} s in the queue for a free generation slot; "
                                              "retry later", "queue_timeout", 2))
            self._forget(waiter)

    def _forget(self, waiter: asyncio.Future[Slot]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _refuse(self, message: str, code: str, retry_after: int) -> Refused:
        self.on_refuse(code)
        return Refused(message, code, retry_after)
