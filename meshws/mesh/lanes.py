"""Per-session order for work that runs off a link's read loop.

A link's read loop must never wait for compute (or it stops answering pings), so
the slow part of a control frame — a release on the compute worker, an `open` or
`close` sent on to the next hop — runs as a task. Tasks of one session run one after
another in the order their frames arrived (an `open` is never overtaken by its
`close`); different sessions do not wait for each other.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("meshws.lanes")


class SessionLanes:
    def __init__(self) -> None:
        self._last: dict[str, asyncio.Task] = {}  # each session's latest task

    def run(self, sid: str, work: Callable[[], Awaitable[Any]]) -> asyncio.Task:
        """Start `work()` once every earlier task of `sid` has finished (whatever their outcome)."""
        previous = self._last.get(sid)

        async def in_order() -> Any:
            if previous is not None:
                await asyncio.wait({previous})
            return await work()

        task = asyncio.create_task(in_order(), name=f"session {sid[:12]}")
        self._last[sid] = task
        task.add_done_callback(lambda done: self._finished(sid, done))
        return task

    def last(self, sid: str) -> asyncio.Task | None:
        """The latest unfinished task of `sid`, if any: what new work for it must wait for."""
        return self._last.get(sid)

    def __len__(self) -> int:
        return len(self._last)

    async def drain(self, sids: set[str] | None = None) -> None:
        """Wait for the tasks of `sids` (every session if None)."""
        tasks = [task for sid, task in list(self._last.items()) if sids is None or sid in sids]
        if tasks:
            await asyncio.wait(tasks)

    def cancel(self) -> None:
        for task in list(self._last.values()):
            task.cancel()

    def _finished(self, sid: str, task: asyncio.Task) -> None:
        if self._last.get(sid) is task:
            del self._last[sid]
        if not task.cancelled() and task.exception() is not None:
            log.error("work of session %s failed", sid[:12], exc_info=task.exception())
