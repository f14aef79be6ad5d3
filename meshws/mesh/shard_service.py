"""`/ws/shard`: the session channels a middle or tail node serves for the hop before it.

One inbound websocket carries many sessions. `open` records a session (its sampling settings, its next
hop) and travels on; `fwd` frames run through the shard on the compute worker, then go to the next hop or,
on the tail, come back as `token`; `close` drops the session's cache here and travels on. When the inbound
link drops, every session that came over it is released the same way. A bad frame gets an `error` frame
naming the problem; the link and its other sessions go on. When the node's layers move (placement), every
session ends as lost first (`move`).

The read loop never waits for compute, so a link answers pings during any step:
tensor frames run as tasks (`shard_steps`), and the slow part of a control frame (a
release, an `open` or `close` sent on) runs in the session's lane (`lanes`), in the
order the frames came. An `open` for a session this node holds on another link (the
head re-routed through a new link) replaces it there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Coroutine

from aiohttp import WSMsgType, web

from ..model.backend import ShardBackend
from .aio import run_uncancelled
from .compute import ComputeWorker
from .inbound import InboundLink, InboundSession, ShardLimits, handshake
from .lanes import SessionLanes
from .link import Link, LinkDown
from .link_pool import LinkPool
from .log_limit import LogLimiter
from .metrics import NodeMetrics
from .next_hops import NextHops
from .shard_steps import ShardSteps
from .standby import Copies, Feeds, tell_closed
from .wire import (Close, ControlMessage, Error, FrameError, Hello, KVAck, Open, SessionReply, Token,
                   decode_control, encode_control, is_kv_frame)
from .wire.fields import MAX_CHAIN

log = logging.getLogger("meshws.shard_service")

MAX_MOVED_AWAY = 4096  # sessions ended by moves whose late steps are still answered "lost"
OPEN_LINK_WAIT = 5.0  # seconds an `open` waits for a next-hop link that is still dialing


class ShardService:
    def __init__(
        self, backend: ShardBackend, worker: ComputeWorker, links: LinkPool, metrics: NodeMetrics,
        *,
        node_name: str,
        hello: Callable[[], Hello],
        static_peer: str | None,
        max_frame_bytes: int,
        compress_min_bytes: int,
        authorize: Callable[[web.Request], str | None] = lambda request: None,
        secret: str | None = None,
        open_routes: bool = False,
        limits: ShardLimits = ShardLimits(),
    ) -> None:
        self.backend, self.worker, self.links, self.metrics = backend, worker, links, metrics
        self.node_name, self.hello, self.static_peer = node_name, hello, static_peer
        self.max_frame_bytes, self.compress_min_bytes = max_frame_bytes, compress_min_bytes
        self.authorize, self.limits = authorize, limits
        self.draining = False  # SIGTERM: sessions running finish; new ones are refused as lost
        self.moving = False  # its layers are being replaced: new sessions are refused as lost
        self.next_hops = NextHops(backend, links, static_peer, secret, open_routes)
        self.log_limit = LogLimiter(log)
        self.inbound: set[web.WebSocketResponse] = set()
        self.sessions: dict[str, InboundSession] = {}  # every live session on this node
        self.pending_tasks: set[asyncio.Task] = set()  # steps and relays still running
        self.lanes = SessionLanes()  # opens and closes going on, in each session's order
        self.steps = ShardSteps(backend, worker, metrics, self.sessions, limits, node_name=node_name,
                                max_frame_bytes=max_frame_bytes, compress_min_bytes=compress_min_bytes,
                                send=self._send, refuse=self._error, spawn=self._spawn)
        self.decode_log = self.steps.decode_log
        self.feeds = self.steps.feeds = Feeds(backend, worker, links, metrics, compress_min_bytes, max_frame_bytes)
        self.copies = Copies(backend, worker, metrics, max_frame_bytes, self._send, self.lanes.run,
                             live=lambda sid: sid in self.sessions)

    url = property(lambda self: self.steps.url, lambda self, value: setattr(self.steps, "url", value),
                   doc="This node's address as heads know it (its advertised one).")

    def note_decode_step(self, sid: str, now: float | None = None) -> int | None:
        return self.decode_log.note(sid, time.monotonic() if now is None else now)

    # -- the websocket ------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        refusal = self.authorize(request)
        if refusal:
            self.log_limit.log("refused", logging.WARNING, "refused /ws/shard from %s: %s", request.remote, refusal)
            raise web.HTTPUnauthorized(text=refusal)
        # Frames up to twice the limit are read and refused with an error frame; larger ones end the link.
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=2 * self.max_frame_bytes + 65536)
        await ws.prepare(request)
        await self.serve_link(ws, str(request.remote))
        return ws

    async def serve_link(self, ws: Any, remote: str) -> None:
        """An inbound link on `ws` until it closes: one the hop before dialed (`handle`), or one this node dialed
        to a hop that cannot dial it (`mesh.reverse`); the same either way."""
        peer = await handshake(ws, remote, self.hello, self.log_limit, self._send_ws)
        if peer is None:
            return
        self.inbound.add(ws)
        link = InboundLink(ws, peer, self.limits)
        try:
            async for message in ws:
                try:
                    if message.type == WSMsgType.TEXT:
                        self.metrics.frame("in", "control", len(message.data))
                        await self._on_control(link, message.data)
                    elif message.type == WSMsgType.BINARY:  # hidden states, or a standby's rows
                        await (self.copies if is_kv_frame(message.data) else self.steps).accept(link, message.data)
                    elif message.type == WSMsgType.ERROR:
                        log.warning("inbound link from %s failed: %s", peer, ws.exception())
                except Exception as exc:  # a frame no check foresaw: say so; the link and its sessions go on
                    self.log_limit.log("frame", logging.ERROR, "frame from %s failed", peer, exc_info=exc)
                    await self._error(link, None, None, f"{self.node_name}: the frame could not be handled: "
                                      f"{type(exc).__name__}", "internal")
        finally:
            self.inbound.discard(ws)
            if ws.close_code not in (None, 1000):
                log.info("inbound link from %s closed (code %s)", peer, ws.close_code)
            await run_uncancelled(self._close_all(link))

    async def _close_all(self, link: InboundLink) -> None:
        sids = set(link.owned)
        for sid in sids:
            session = self.sessions.get(sid)
            if session is not None and session.link is link:
                self._let_go(link, session, "inbound link dropped")
        self.copies.link_lost(link)
        await self.lanes.drain(sids)

    async def move(self, adopt: Callable[[], Coroutine[Any, Any, Any]]) -> int:
        """Replace this node's layers (`adopt`) with no session crossing the change: new sessions are refused as
        lost meanwhile, every session ends first (the hop before hears each as lost, and a step of it that comes
        later is answered lost too, so its head routes it anew), then the inbound links hear the new hello. How many
        sessions ended."""
        self.moving = True
        try:
            ended = list(self.sessions.values())
            for session in ended:
                if session.link is not None:
                    await self._send(session.link, Error(message=f"{self.node_name}: its layers moved; route around it",
                                                         sid=session.sid, lost=True, url=self.url))
                self._end(session, reason="layers moved")
                self.steps.moved_away[session.sid] = None
            while len(self.steps.moved_away) > MAX_MOVED_AWAY:
                del self.steps.moved_away[next(iter(self.steps.moved_away))]
            await adopt()
        finally:
            self.moving = False
        await self.announce()
        return len(ended)

    async def announce(self) -> None:
        """Send an updated hello (our chain changed) to every inbound link."""
        for ws in list(self.inbound):
            await self._send_ws(ws, self.hello())

    # -- control frames -----------------------------------------------------

    async def _on_control(self, link: InboundLink, text: str) -> None:
        """Handle a control frame on the read loop: state changes now, slow work in the session's lane."""
        try:
            message = decode_control(text)
        except FrameError as exc:
            await self._error(link, exc.sid, None, f"bad frame: {exc}", "bad_frame")
            return
        if isinstance(message, Open):
            await self._open(link, message)
        elif isinstance(message, Close):
            session = self.sessions.get(message.sid)
            if session is not None and session.link is link:
                self._let_go(link, session, "replaced" if message.grace else "closed")
            else:
                self.copies.closed(link, message.sid, message.grace)
        elif isinstance(message, Hello):
            await self._error(link, None, None, "hello was already exchanged on this link", "bad_frame")
        else:
            await self._error(link, getattr(message, "sid", None), getattr(message, "step", None),
                              f"a shard does not accept {message.type!r} frames", "bad_frame")

    async def _open(self, link: InboundLink, message: Open) -> None:
        sid = message.sid
        try:
            next_url, route = self.next_hops.choose(message)
        except ValueError as exc:
            await self._error(link, sid, None, f"bad open: {exc}", "bad_frame")
            return
        if self.draining or self.moving:  # lost: the head routes the session around this node, as if it had gone
            self.metrics.errors.labels("draining" if self.draining else "moved").inc()
            doing = "shutting down" if self.draining else "moving its layers"
            await self._send(link, Error(message=f"{self.node_name} is {doing}; route around it", sid=sid, lost=True,
                                               url=self.url))
            return
        span = (self.backend.start, self.backend.end)
        if message.layers is not None and message.layers != span:  # moved since the route was planned: lost too
            self.metrics.errors.labels("moved").inc()
            await self._send(link, Error(message=f"{self.node_name} serves layers {span[0]}-{span[1] - 1} now, not "
                                         f"{message.layers[0]}-{message.layers[1] - 1}; route around it", sid=sid,
                                         lost=True, url=self.url))
            return
        earlier = self.sessions.get(sid)
        next_hop = self.links.get(next_url) if next_url else None
        if message.resume and earlier is not None and earlier.link is link:
            if earlier.step_task is not None:  # (the head gave its step up: the session goes on from its cache)
                earlier.step_task.cancel()
                await asyncio.wait({earlier.step_task})
            self._resume(earlier, message, route, next_hop)
            return
        if len(link.owned) - (earlier is not None and earlier.link is link) >= self.limits.link_sessions:
            await self._error(link, sid, None, f"{self.node_name}: this link already carries "
                              f"{self.limits.link_sessions} sessions, the limit", "link_busy")
            return  # (before ending an earlier session of this id: a refused open changes nothing)
        if earlier is not None and earlier.link is not None:  # a re-open (a new route after a failure), on this
            # link or another: start clean, or (resume) from its cache, handed over as a copy (`_let_go`)
            self._let_go(earlier.link, earlier, "re-opened" if earlier.link is link else "re-opened on another link",
                         keep=message.resume)
        session = InboundSession(sid, message.sampling, message.prompt_tokens, next_hop, route, link=link,
                                 hold=message.hold)
        session.after = self.lanes.last(sid)  # the release of an earlier session of this id goes first
        if message.fork is not None and message.fork[0] in link.owned:  # (never another link's session)
            fork = message.fork  # in the lane: before the steps, and before a close's release
            session.after = self.lanes.run(sid, lambda: self._fork(fork, sid))
        elif message.fork is not None:
            message = replace(message, fork=None)  # nor does a hop behind us copy one
        if message.resume:
            self.copies.adopt(sid)  # (a copy this node kept for another: the head resumes it here)
        self.sessions[sid] = session
        link.owned.add(sid)
        if (standby := self.next_hops.standby(message)) is not None:
            self.feeds.start(session, standby)
        if message.kept:
            self.backend.sessions.keep_apart(sid)
        if next_hop is not None:
            next_hop.subscribe(sid, self._relay_to(link))
            onward = self.next_hops.onward(message, route)
            # The link may still be dialing: the open goes on in the lane; steps wait for it.
            session.forwarding = self.lanes.run(sid, lambda: self._forward_open(next_hop, onward))

    async def _fork(self, fork: tuple[str, int], sid: str) -> None:
        """Start `sid`'s cache as a copy of the first positions of another session (steps wait for it)."""
        try:
            await self.worker.call(self.backend.fork_session, fork[0], sid, fork[1])
        except Exception as exc:  # the copy is an optimisation: without it the first step misses and re-prefills
            log.info("session %s: no fork of %s (%s)", sid[:12], fork[0][:12], exc)

    def _resume(self, session: InboundSession, message: Open, route: tuple, next_hop: Link | None) -> None:
        """A conversation's next turn on the same link: the cache stays, the sampling is new. A new next hop (the
        one before went, and the head resumes on its standby) takes the session's replies from now on."""
        session.sampling, session.prompt_tokens, session.route = message.sampling, message.prompt_tokens, route
        session.history = None  # the turn's first step carries the token ids when sampling needs them
        if next_hop is not session.next_hop and session.link is not None:
            if session.next_hop is not None:  # (gone, or lost its cache: what it held, the standby holds)
                session.next_hop.unsubscribe(session.sid)
                self._spawn(tell_closed(session.next_hop, session.sid, grace=True))
            session.next_hop = next_hop
            if next_hop is not None:
                next_hop.subscribe(session.sid, self._relay_to(session.link))
        if next_hop is not None:
            onward = self.next_hops.onward(message, route)
            session.forwarding = self.lanes.run(session.sid, lambda: self._forward_open(next_hop, onward))

    async def _forward_open(self, next_hop: Link, message: Open) -> str | None:
        """Send `open` on; None when done, else why it could not be."""
        if not next_hop.is_up:
            await next_hop.wait_up(OPEN_LINK_WAIT)
        try:
            await next_hop.send_control(message)
            return None
        except LinkDown as exc:
            return f"{self.node_name}: next hop unreachable: {exc}"

    def _relay_to(self, link: InboundLink) -> Callable[[SessionReply], None]:
        """Replies from the next hop go back to the hop before us; a lost link says where it was."""

        def relay(message: SessionReply) -> None:
            if isinstance(message, KVAck):
                return  # (a standby's answers are for this node's feeds alone)
            session = self.sessions.get(message.sid)
            if session is not None:
                self.steps.answered(session, getattr(message, "step", None))
                if isinstance(message, Token) and len(message.hops) < MAX_CHAIN:  # our part goes in front
                    message = replace(message, hops=self.steps.own_report(session, message.step) + message.hops)
            if isinstance(message, Error) and message.lost:
                message = replace(message, message=f"{self.node_name}: {message.message}")
            self._spawn(self._send(link, message))

        return relay

    def _let_go(self, link: InboundLink, session: InboundSession, reason: str, keep: bool = True) -> None:
        if keep and session.hold and reason != "closed":  # (the hop before had a standby: a head may resume there)
            self.copies.orphan(link, session.sid)
        self._end(session, reason)

    def _end(self, session: InboundSession, reason: str) -> None:
        """Forget a session now (its step is cancelled); release it and close it onward in its lane."""
        sid = session.sid
        if self.sessions.get(sid) is session:
            del self.sessions[sid]
        if session.link is not None:
            session.link.owned.discard(sid)
        self.steps.answered(session)
        if session.step_task is not None:
            session.step_task.cancel()  # no work for the departed: the worker skips what is left
        if session.next_hop is not None:
            session.next_hop.unsubscribe(sid)
        self.lanes.run(sid, lambda kept=self.copies.holds(sid): self._release(session, reason, kept))  # (a copy now)

    async def _release(self, session: InboundSession, reason: str, kept: bool = False) -> None:
        sid = session.sid
        try:
            if not kept:
                await self.worker.release(sid)
        except RuntimeError:  # the worker is shut down: the node clears every cache as it stops
            pass
        self.decode_log.forget(sid)
        await self.feeds.stop(session, "now" if reason == "closed" else None if self.draining else "later")
        if session.next_hop is not None and not kept:
            await tell_closed(session.next_hop, sid, grace=reason != "closed")
        log.info(
            "session %s %s: %d prefill(s), %d decode steps, %d cache misses, %.1f ms compute, %.1f s open",
            sid[:12], reason, session.prefills, session.decodes, session.cache_misses,
            session.compute_seconds * 1000, time.monotonic() - session.opened,
        )

    # -- sending ------------------------------------------------------------

    async def _error(self, link: InboundLink, sid: str | None, step: int | None, text: str, kind: str) -> None:
        self.metrics.errors.labels(kind).inc()
        await self._send(link, Error(message=text, sid=sid, step=step))

    async def _send(self, link: InboundLink, message: ControlMessage) -> None:
        await self._send_ws(link.ws, message)

    async def _send_ws(self, ws: web.WebSocketResponse, message: ControlMessage) -> None:
        if ws.closed:
            return
        text = encode_control(message)
        try:
            await ws.send_str(text)
            self.metrics.frame("out", message.type, len(text))
        except (ConnectionError, RuntimeError):
            pass  # the link is going away; its sessions are released when the loop ends

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self.pending_tasks.add(task)
        task.add_done_callback(self.pending_tasks.discard)
        return task

    async def shutdown(self) -> None:
        self.feeds.stop_all()
        for ws in list(self.inbound):
            await ws.close(code=1001, message=b"node shutting down")
        for task in list(self.pending_tasks):
            task.cancel()
        self.lanes.cancel()

