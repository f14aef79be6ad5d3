"""Standbys: a session's keys and values kept on a second node of the same layers, so that when the node serving
it dies or drains, the head resumes the session there instead of prefilling it again.

The serving side (`Feeds`): a session whose `open` names a standby (signed by the head: `NextHops.standby`) gets a
feed. After each of its steps the positions the standby lacks are read from the cache as stored (`export_kv`, on
the compute worker) and sent on the link to the standby as `kv` frames of at most FRAME_POSITIONS positions, at
most IN_FLIGHT of them unanswered: the bytes in flight stay bounded, and a standby that falls behind is caught up
later from the cache, never from a queue. The standby answers each frame with `kv_ack` (the positions it holds),
which this node reports in its part of each answer (`HopReport.standby`): the head resumes from there. When the
session ends here the standby is told (`close`); when this node drains or stops, it is not.

The standby side (`Copies`): a `kv` frame is checked and written into this node's copy of the session
(`import_kv`: counted apart from users' sessions, within the byte budget), in the session's lane, and answered.
A `close` from the link that sent it lets the copy go; so does that link's loss, after GRACE seconds in which no
head resumed the session here. An `open` of the session on this node adopts the copy (`adopt`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Awaitable, Callable

from ..model.kv.cache_store import CacheBudgetExceeded
from ..model.backend import KVRows
from .compute import ComputeWorker
from .inbound import InboundLink
from .link import Link, LinkDown
from .link_pool import LinkPool
from .metrics import NodeMetrics
from .wire import Close, ControlMessage, Error, FrameError, KVAck, SessionReply, decode_kv, encode_kv

log = logging.getLogger("meshws.standby")

FRAME_POSITIONS = 256  # positions one kv frame carries at most
IN_FLIGHT = 2  # kv frames of one session sent and not yet answered
ANSWER_WAIT = 30.0  # seconds a feed waits for a standby's answer before it gives the standby up
LINK_WAIT = 5.0  # seconds a feed waits for its link to the standby to come up
GRACE = 60.0  # seconds a copy outlives the link that fed it, waiting for a head to resume the session here
OFF_LOOP_BYTES = 1 << 20  # frames at least this large are packed off the event loop
QUEUED_BYTES = 256 << 20  # rows a standby holds received and not yet written, from every link at once


async def tell_closed(link: Link, sid: str, grace: bool = False) -> None:
    """`close` for `sid` on `link`, if it is up: the node there lets the session (or its copy) go; with `grace`, a
    copy waits GRACE for a head first (the session may be resuming there)."""
    try:
        await link.send_control(Close(sid=sid, grace=grace))
    except LinkDown:
        pass  # it releases the session when our link to it drops


class Feed:
    def __init__(self, sid: str, link: Link, owner: Any) -> None:
        self.sid, self.link = sid, link
        self.owner = owner  # the session (`InboundSession`) it feeds: a re-open's feed is another's
        self.sent = 0  # positions sent to the standby (it holds them once it answers)
        self.trusted = 0  # positions the standby holds as this node's cache holds them (what it acked, less cuts)
        self.pending: deque[list[int]] = deque()  # each frame in flight: [where it ends, what its answer vouches for]
        self.wake, self.answered = asyncio.Event(), asyncio.Event()
        self.task: asyncio.Task | None = None
        self.gone = False  # the standby or its link went: nothing more is sent

    def reply(self, message: SessionReply) -> None:
        if isinstance(message, KVAck):
            end, vouched = self.pending.popleft() if self.pending else (message.length, message.length)
            if message.length < end:  # it lacks earlier positions (or holds fewer): from there again
                self.sent = min(self.sent, message.length)
                self.wake.set()
            self.trusted = min(message.length, vouched)
            self.answered.set()
        elif isinstance(message, Error):
            self.gone = True
            self.answered.set()
            if message.lost is False:
                log.info("session %s: standby %s refused its copy: %s", self.sid[:12], self.link.url, message.message)

    def sending(self, start: int, end: int) -> None:
        """A frame of positions `start .. end` goes. Starting below what was sent, it follows a cut: what the
        frames before it (and their answers) vouch for ends at `start`."""
        for entry in self.pending:
            entry[1] = min(entry[1], start)
        self.trusted = min(self.trusted, start)
        self.sent = end
        self.pending.append([end, end])


class Feeds:
    """The sessions this node serves that have a standby, and what each standby holds."""

    def __init__(self, backend: Any, worker: ComputeWorker, links: LinkPool, metrics: NodeMetrics,
                 compress_min_bytes: int, max_frame_bytes: int) -> None:
        self.backend, self.worker, self.links, self.metrics = backend, worker, links, metrics
        self.compress_min_bytes = compress_min_bytes
        self.frame_bytes = max_frame_bytes // 2  # a frame's rows at most: within what the standby accepts
        self.feeds: dict[str, Feed] = {}
        self.telling: set[asyncio.Task] = set()  # closes sent to standbys given up (held: a task may not vanish)

    def start(self, session: Any, url: str) -> None:
        """Feed `session` (an `InboundSession`)'s standby at `url` from now on (an earlier feed of its id ends)."""
        if getattr(self.backend, "export_kv", None) is None:
            return
        sid = session.sid
        earlier = self.feeds.pop(sid, None)
        if earlier is not None:
            self._halt(earlier)
            if earlier.link.url != url.rstrip("/"):  # (another standby now: the earlier one's copy goes)
                task = asyncio.create_task(tell_closed(earlier.link, sid))
                self.telling.add(task)
                task.add_done_callback(self.telling.discard)
        feed = Feed(sid, self.links.get(url), session)
        feed.link.subscribe(sid, feed.reply)
        feed.task = asyncio.create_task(self._run(feed))
        self.feeds[sid] = feed

    def stepped(self, sid: str) -> None:
        """The session's cache changed: its standby is sent what it lacks."""
        feed = self.feeds.get(sid)
        if feed is not None:
            feed.wake.set()

    def held(self, sid: str) -> int | None:
        """The positions the session's standby holds as this node's cache does (None: it has no standby; 0: its
        feed stopped): what this node reports in its part of each answer."""
        feed = self.feeds.get(sid)
        if feed is None:
            return None
        return 0 if feed.gone else min(feed.trusted, self.backend.kv_unchanged(sid))

    async def stop(self, session: Any, tell: str | None) -> None:
        """`session` ends here: its feed stops, and its standby lets the copy go `now`, or `later` (after GRACE,
        unless a head resumes the session there first), or (None: this node stops) when our link drops."""
        feed = self.feeds.get(session.sid)
        if feed is None or feed.owner is not session:
            return
        del self.feeds[session.sid]
        self._halt(feed)
        if tell is not None and feed.link.is_up:
            await tell_closed(feed.link, feed.sid, grace=tell == "later")

    def stop_all(self) -> None:
        """The node stops: no standby is told (the head resumes the sessions there)."""
        for feed in self.feeds.values():
            self._halt(feed)
        self.feeds.clear()

    @staticmethod
    def _halt(feed: Feed) -> None:
        if feed.task is not None:
            feed.task.cancel()
        feed.link.unsubscribe(feed.sid)

    async def _run(self, feed: Feed) -> None:
        try:
            while not feed.gone:
                await feed.wake.wait()
                feed.wake.clear()
                while not feed.gone and await self._send_more(feed):
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a feed is a convenience: the session goes on without it
            log.warning("session %s: standby feed to %s stopped: %s", feed.sid[:12], feed.link.url, exc)
            feed.gone = True

    async def _send_more(self, feed: Feed) -> bool:
        """One more frame, when the standby lacks positions and may take one; whether one went."""
        while len(feed.pending) >= IN_FLIGHT:
            feed.answered.clear()
            try:
                async with asyncio.timeout(ANSWER_WAIT):
                    await feed.answered.wait()
            except TimeoutError:
                log.warning("session %s: standby %s did not answer; giving it up", feed.sid[:12], feed.link.url)
                feed.gone = True
            if feed.gone:
                return False
        rows: KVRows | None = await self.worker.call(self.backend.export_kv, feed.sid, feed.sent, FRAME_POSITIONS,
                                                     self.frame_bytes)
        if rows is None or rows.count == 0:
            return False
        pack = (rows.start, rows.dtype, rows.shape, rows.body, self.compress_min_bytes)
        data = await asyncio.to_thread(encode_kv, feed.sid, *pack) if len(rows.body) >= OFF_LOOP_BYTES \
            else encode_kv(feed.sid, *pack)
        if not feed.link.is_up and not await feed.link.wait_up(LINK_WAIT):
            feed.gone = True
            return False
        feed.sending(rows.start, rows.start + rows.count)  # (before: its answer may come while the send drains)
        try:
            await feed.link.send_frame(data)
        except LinkDown:
            feed.gone = True
            return False
        self.metrics.frame("out", "kv", len(data))
        return True


class Copies:
    """This node's copies of sessions other nodes serve."""

    def __init__(self, backend: Any, worker: ComputeWorker, metrics: NodeMetrics, max_frame_bytes: int,
                 send: Callable[[InboundLink, ControlMessage], Awaitable[None]],
                 lane: Callable[[str, Callable[[], Awaitable[Any]]], Any], live: Callable[[str], bool]) -> None:
        self.backend, self.worker, self.metrics = backend, worker, metrics
        self.max_frame_bytes = max_frame_bytes
        self._send, self._lane, self._live = send, lane, live
        self.held: dict[str, InboundLink] = {}  # sid -> the link its rows come over
        self._expiring: dict[str, asyncio.TimerHandle] = {}
        self.queued_bytes = 0  # rows received and not yet written (every link): within QUEUED_BYTES

    async def accept(self, link: InboundLink, data: bytes) -> None:
        """A `kv` frame from `link`: checked, then written in the session's lane (never waits for the worker)."""
        self.metrics.frame("in", "kv", len(data))
        try:  # (off the loop: a small frame may declare a large body)
            frame = await asyncio.to_thread(decode_kv, data, self.max_frame_bytes)
        except FrameError as exc:
            await self._send(link, Error(message=f"bad standby frame: {exc}", sid=exc.sid))
            return
        sid = frame.sid
        holder = self.held.get(sid)
        problem = "this node keeps no copies" if getattr(self.backend, "import_kv", None) is None else \
            "this node serves that session" if self._live(sid) else \
            "another link feeds that session's copy" if holder is not None and holder is not link else \
            f"this link already feeds {len(link.copies)} copies, the limit" \
            if holder is None and len(link.copies) >= link.limits.link_sessions else \
            "rows received and not yet written fill this node's budget" \
            if self.queued_bytes + len(frame.body) > QUEUED_BYTES else None
        if problem is not None:
            await self._send(link, Error(message=f"standby refused: {problem}", sid=sid))
            return
        self.held[sid] = link
        link.copies.add(sid)
        rows = KVRows(frame.start, frame.dtype, frame.shape, frame.body)
        self.queued_bytes += len(rows.body)
        self._lane(sid, lambda: self._import(link, sid, rows))

    async def _import(self, link: InboundLink, sid: str, rows: KVRows) -> None:
        def written() -> int | None:  # (on the worker: a copy adopted meanwhile is a session, not written to)
            return self.backend.import_kv(sid, rows) if self.held.get(sid) is link else None

        try:
            length = await self.worker.call(written)
            if length == 0 and rows.start > 0:  # (the copy went meanwhile: the byte budget took it)
                raise ValueError("its copy was let go")
        except (ValueError, CacheBudgetExceeded) as exc:
            if self.held.get(sid) is link:
                self._forget(sid)
                await self.worker.release(sid)
            await self._send(link, Error(message=f"standby refused: {exc}", sid=sid))
            return
        finally:
            self.queued_bytes -= len(rows.body)
        if length is not None:
            await self._send(link, KVAck(sid=sid, length=length))

    def closed(self, link: InboundLink, sid: str, grace: bool = False) -> bool:
        """A `close` from `link` for a copy it feeds: the copy goes (with `grace`: after GRACE, unless a head
        resumes the session here first). Whether it was one."""
        if self.held.get(sid) is not link:
            return False
        if grace:
            if sid not in self._expiring:
                self._expiring[sid] = asyncio.get_running_loop().call_later(GRACE, self._expire, link, sid)
            return True
        self._forget(sid)
        self._lane(sid, lambda: self.worker.release(sid))
        return True

    def link_lost(self, link: InboundLink) -> None:
        """The feeding node's link went (it died, drained or restarted): its copies wait GRACE for a head."""
        loop = asyncio.get_running_loop()
        for sid in list(link.copies):
            if self.held.get(sid) is link and sid not in self._expiring:
                self._expiring[sid] = loop.call_later(GRACE, self._expire, link, sid)

    def orphan(self, link: InboundLink, sid: str) -> None:
        """`sid`'s session came over `link`, which dropped, from a hop that had a standby: its cache stays as a
        copy, which a head resuming the session on that standby finds here (or which goes after GRACE)."""
        if sid not in self.held:
            self.backend.sessions.keep_apart(sid, "standby")
            self.held[sid] = link
            link.copies.add(sid)
            self.closed(link, sid, grace=True)

    def holds(self, sid: str) -> bool:
        return sid in self.held

    def adopt(self, sid: str) -> bool:
        """A head opened the session here: the copy is this node's session now (whether there was one)."""
        if sid not in self.held:
            return False
        self._forget(sid)
        return bool(self.backend.sessions.adopt(sid))

    def _expire(self, link: InboundLink, sid: str) -> None:
        self._expiring.pop(sid, None)
        if self.held.get(sid) is link:
            log.info("session %s: standby copy let go (its node went and no head resumed it)", sid[:12])
            self.closed(link, sid)

    def _forget(self, sid: str) -> None:
        link = self.held.pop(sid, None)
        if link is not None:
            link.copies.discard(sid)
        timer = self._expiring.pop(sid, None)
        if timer is not None:
            timer.cancel()
