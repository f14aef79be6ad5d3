"""A link's outbox of decode rows: the steps of one wave bound for one hop leave as one frame.

A node's worker computes a wave of sessions' decode steps in one batch and hands their results
back together (`ComputeWorker._delivered`); each session's task then sends its step on. Sent one
frame each, a wave of 16 crossed a hop as 16 headers, 16 bodies and 16 turns of both event loops.
Here the rows a link is handed in one turn of the event loop wait for the turn's end and go as one
frame (`encode_rows`); a lone row goes as the plain frame it always was, and one computed alone
(`group` 1) goes at once. The turn lasts while rows keep coming, up to the wave they say they
belong to (`group`) or a few turns, never on a clock.

Each row keeps its session's semantics: the receiver runs it as the step it would have been alone,
and a link that fails fails every row waiting on it, each with its own `LinkDown`. A control frame
sent on the link first sends the rows handed to it before (`flush`): a `close` never overtakes the
step before it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from .wire import DecodeRow, encode_forward, encode_rows

TURNS = 4  # event-loop turns a wave's rows may take to come together, at most
MAX_ROW_BYTES = 4 << 20  # a wave's frame larger than this is split
MAX_FRAME_ROWS = 256  # ... and one of more rows (well inside what a receiver takes: MAX_GROUP, its header limit)


def travels_in_waves(mode: str, shape: tuple[int, ...] | list[int], ids: object, drafts: tuple[int, ...]) -> bool:
    """Is this step a plain decode row (one position, no ids, no drafts), which may share its wave's frame?"""
    return mode == "decode" and ids is None and not drafts and len(shape) == 3 and tuple(shape[:2]) == (1, 1)


class RowOutbox:
    """(One per link.) Decode rows waiting for the end of the event loop's turn."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]],
                 lost: Callable[[str], Exception] = ConnectionError) -> None:
        self._send = send
        self._lost = lost  # the exception a row's sender gets when its frame's sending was cancelled
        self._waiting: list[tuple[DecodeRow, int, str, int, asyncio.Future]] = []
        self._turns = 0  # turns the waiting rows have waited
        self._seen = 0  # rows waiting at the last turn's end
        self._flushing: set[asyncio.Task] = set()
        self._order = asyncio.Lock()  # one flush at a time: a control frame waits for the rows taken before it
        self.frames = 0  # frames sent with several rows
        self.rows = 0  # rows that went in them

    async def send(self, row: DecodeRow, hidden: int, dtype: str, compress_min_bytes: int) -> int:
        """Send a row: at once if it was computed alone (`group` 1: no wave to wait for) and no rows wait, else
        with the rows of this turn (`add`). Returns the bytes it took on the wire (its share of its frame)."""
        if row.group > 1 or self._waiting:
            return await self.add(row, hidden, dtype, compress_min_bytes)
        data = _frame_of([row], hidden, dtype, compress_min_bytes)
        await self._send(data)
        return len(data)

    def add(self, row: DecodeRow, hidden: int, dtype: str, compress_min_bytes: int) -> asyncio.Future:
        """Queue a row; the future is done once its frame is sent (or holds the link's failure)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._waiting:
            self._turns, self._seen = 0, 0
            loop.call_soon(self._turn_over)
        self._waiting.append((row, hidden, dtype, compress_min_bytes, done))
        return done

    def _turn_over(self) -> None:
        """A turn ended: wait one more while rows still come and the wave they name is not all here."""
        count = len(self._waiting)
        if not count:
            return
        wave = max(entry[0].group for entry in self._waiting)
        self._turns += 1
        if count > self._seen and count < wave and self._turns < TURNS:
            self._seen = count
            asyncio.get_running_loop().call_soon(self._turn_over)
            return
        self._flush_task()

    def _flush_task(self) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._flush())
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)
        return task

    async def flush(self) -> None:
        """Send every row waiting, and wait for flushes under way: then nothing handed over before is still to
        go. (In a task of its own: a caller cancelled meanwhile leaves no row unsent and no sender waiting.)"""
        await asyncio.shield(self._flush_task())

    async def _flush(self) -> None:
        """One frame per kind of row (width, dtype), lone rows as plain frames."""
        async with self._order:
            await self._flush_waiting()

    async def _flush_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        kinds: dict[tuple[int, str, int], list[tuple[DecodeRow, asyncio.Future]]] = {}
        for row, hidden, dtype, compress_min_bytes, done in waiting:
            kinds.setdefault((hidden, dtype, compress_min_bytes), []).append((row, done))
        for (hidden, dtype, compress_min_bytes), entries in kinds.items():
            per_frame = max(1, min(MAX_FRAME_ROWS, MAX_ROW_BYTES // max(1, len(entries[0][0].body))))
            for at in range(0, len(entries), per_frame):
                await self._send_frame(entries[at : at + per_frame], hidden, dtype, compress_min_bytes)

    async def _send_frame(self, entries: list[tuple[DecodeRow, asyncio.Future]], hidden: int, dtype: str,
                          compress_min_bytes: int) -> None:
        rows = [row for row, _ in entries]
        try:
            data = _frame_of(rows, hidden, dtype, compress_min_bytes)
            await self._send(data)
        except BaseException as exc:  # (LinkDown; or cancelled, the node stopping): each row's sender hears it
            for _, done in entries:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, Exception) else self._lost("its sending was cancelled"))
            if not isinstance(exc, Exception):
                raise
            return
        if len(rows) > 1:
            self.frames += 1
            self.rows += len(rows)
        for _, done in entries:
            if not done.done():
                done.set_result(len(data) // len(rows))


def _frame_of(rows: list[DecodeRow], hidden: int, dtype: str, compress_min_bytes: int) -> bytes:
    """Rows as a wave's frame, or one row as the one-step frame it always was."""
    if len(rows) > 1:
        return encode_rows(rows, hidden, dtype, compress_min_bytes)
    row = rows[0]
    return encode_forward(row.sid, row.step, "decode", row.past_len, (1, 1, hidden), dtype, row.body,
                          compress_min_bytes=compress_min_bytes, group=row.group)
