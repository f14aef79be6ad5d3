"""`/ws/shard`: the session channels a middle or tail node serves for the hop before it.

One inbound websocket carries many sessions. `open` records a session (its
sampling settings, its next hop) and travels on; `fwd` frames run through the
shard on the compute worker, then go to the next hop or, on the tail, come back
as `token`; `close` drops the session's cache here and travels on. When the
inbound link drops, every session that came over it is released the same way.
A bad frame gets an `error` frame naming the problem; the link and its other
sessions go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Coroutine

from aiohttp import WSMsgType, web

from ..model.backend import DecodeStep, ShardBackend, StepResult, TailTokenResult
from ..model.cache_store import CacheBudgetExceeded, KVCacheMiss
from .aio import run_uncancelled
from .compute import ComputeWorker
from .inbound import DecodeLogThrottle, InboundSession
from .link import Link, LinkDown, LinkPool
from .log_limit import LogLimiter
from .next_hops import NextHops
from .metrics import NodeMetrics
from .wire import (
    CacheMiss,
    Close,
    ControlMessage,
    Error,
    ForwardFrame,
    FrameError,
    Hello,
    Open,
    RouteHop,
    SessionReply,
    Token,
    decode_control,
    decode_forward,
    encode_control,
    encode_forward,
)

log = logging.getLogger("meshws.shard_service")

OPEN_LINK_WAIT = 5.0  # seconds an `open` waits for a next-hop link that is still dialing
HELLO_WAIT = 15.0  # seconds a dialer has to send its hello


class ShardService:
    def __init__(
        self,
        backend: ShardBackend,
        worker: ComputeWorker,
        links: LinkPool,
        metrics: NodeMetrics,
        *,
        node_name: str,
        hello: Callable[[], Hello],
        static_peer: str | None,
        max_frame_bytes: int,
        compress_min_bytes: int,
        authorize: Callable[[web.Request], str | None] = lambda request: None,
        secret: str | None = None,
        open_routes: bool = False,
    ) -> None:
        self.backend = backend
        self.worker = worker
        self.links = links
        self.metrics = metrics
        self.node_name = node_name
        self.hello = hello
        self.static_peer = static_peer
        self.max_frame_bytes = max_frame_bytes
        self.compress_min_bytes = compress_min_bytes
        self.authorize = authorize
        self.next_hops = NextHops(backend.is_tail, backend.end, links, static_peer, secret, open_routes)
        self.decode_log = DecodeLogThrottle()
        self.log_limit = LogLimiter(log)
        self.inbound: set[web.WebSocketResponse] = set()
        self.sessions: dict[str, InboundSession] = {}  # every live session on this node
        self.pending_tasks: set[asyncio.Task] = set()  # frame handlers and relays still running

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
        peer = await self._handshake(ws, request)
        if peer is None:
            return ws
        self.inbound.add(ws)
        owned: set[str] = set()
        try:
            async for message in ws:
                if message.type == WSMsgType.TEXT:
                    self.metrics.frame("in", "control", len(message.data))
                    await self._on_control(ws, owned, message.data)
                elif message.type == WSMsgType.BINARY:
                    self._spawn(self._on_forward(ws, owned, message.data))
                elif message.type == WSMsgType.ERROR:
                    log.warning("inbound link from %s failed: %s", peer, ws.exception())
        finally:
            self.inbound.discard(ws)
            if ws.close_code not in (None, 1000):
                log.info("inbound link from %s closed (code %s)", peer, ws.close_code)
            await run_uncancelled(self._close_all(owned))
        return ws

    async def _close_all(self, owned: set[str]) -> None:
        for sid in list(owned):
            await self._close_session(sid, owned, reason="inbound link dropped")

    async def _handshake(self, ws: web.WebSocketResponse, request: web.Request) -> str | None:
        """The dialer's hello first; ours in answer. None (and the link closed) when it does not fit."""
        try:
            message = await ws.receive(timeout=HELLO_WAIT)
            if message.type != WSMsgType.TEXT:
                raise FrameError("the first frame must be a hello text frame")
            hello = decode_control(message.data)
            if not isinstance(hello, Hello):
                raise FrameError(f"the first frame must be hello, not {hello.type}")
            mine = self.hello()
            if hello.model != mine.model:
                raise FrameError(f"this node serves model {mine.model!r}, not {hello.model!r}")
        except (FrameError, asyncio.TimeoutError) as exc:
            reason = str(exc) or f"no hello within {HELLO_WAIT:.0f} s"
            self.log_limit.log("refused link", logging.WARNING, "refused link from %s: %s", request.remote, reason)
            await self._send(ws, Error(f"link refused: {reason}"))
            await ws.close(code=1008, message=reason[:120].encode())
            return None
        await self._send(ws, self.hello())
        return hello.node

    async def announce(self) -> None:
        """Send an updated hello (our chain changed) to every inbound link."""
        for ws in list(self.inbound):
            await self._send(ws, self.hello())

    # -- control frames -----------------------------------------------------

    async def _on_control(self, ws: web.WebSocketResponse, owned: set[str], text: str) -> None:
        try:
            message = decode_control(text)
        except FrameError as exc:
            await self._error(ws, exc.sid, None, f"bad frame: {exc}", "bad_frame")
            return
        if isinstance(message, Open):
            await self._open(ws, owned, message)
        elif isinstance(message, Close):
            if message.sid in owned:
                await self._close_session(message.sid, owned, reason="closed")
        elif isinstance(message, Hello):
            await self._error(ws, None, None, "hello was already exchanged on this link", "bad_frame")
        else:
            await self._error(ws, getattr(message, "sid", None), getattr(message, "step", None),
                              f"a shard does not accept {message.type!r} frames", "bad_frame")

    async def _open(self, ws: web.WebSocketResponse, owned: set[str], message: Open) -> None:
        sid = message.sid
        try:
            next_url, route = self.next_hops.choose(message)
        except ValueError as exc:
            await self._error(ws, sid, None, f"bad open: {exc}", "bad_frame")
            return
        if sid in self.sessions and sid not in owned:
            await self._error(ws, sid, None, "session id already in use on another link", "bad_frame")
            return
        if sid in owned:  # re-open (a new route after a failure): start clean
            await self._close_session(sid, owned, reason="re-opened")
        next_hop = self.links.get(next_url) if next_url else None
        session = InboundSession(sid, message.sampling, message.prompt_tokens, next_hop, route)
        self.sessions[sid] = session
        owned.add(sid)
        if next_hop is not None:
            next_hop.subscribe(sid, self._relay_to(ws))
            onward = self.next_hops.onward(message, route)
            # The link may still be dialing: forward in the background; steps wait for it.
            session.forwarding = asyncio.ensure_future(self._forward_open(next_hop, onward))

    async def _forward_open(self, next_hop: Link, message: Open) -> str | None:
        """Send `open` on; None when done, else why it could not be."""
        if not next_hop.is_up:
            await next_hop.wait_up(OPEN_LINK_WAIT)
        try:
            await next_hop.send_control(message)
            return None
        except LinkDown as exc:
            return f"{self.node_name}: next hop unreachable: {exc}"

    def _relay_to(self, ws: web.WebSocketResponse) -> Callable[[SessionReply], None]:
        """Replies from the next hop go back to the hop before us; a lost link says where it was."""

        def relay(message: SessionReply) -> None:
            if isinstance(message, Error) and message.lost:
                message = Error(f"{self.node_name}: {message.message}", message.sid, message.step, True, message.url)
            self._spawn(self._send(ws, message))

        return relay

    async def _close_session(self, sid: str, owned: set[str], reason: str) -> None:
        owned.discard(sid)
        session = self.sessions.pop(sid, None)
        await self.worker.call(self.backend.release_session, sid)
        self.decode_log.forget(sid)
        if session is None:
            return
        if session.next_hop is not None:
            session.next_hop.unsubscribe(sid)
            if session.forwarding is not None:
                await session.forwarding  # the close must not overtake the open
            try:
                await session.next_hop.send_control(Close(sid))
            except LinkDown:
                pass  # the next hop releases the session when our link to it drops
        log.info(
            "session %s %s: %d prefill(s), %d decode steps, %d cache misses, %.1f ms compute, %.1f s open",
            sid[:12], reason, session.prefills, session.decodes, session.cache_misses,
            session.compute_seconds * 1000, time.monotonic() - session.opened,
        )

    # -- tensor frames ------------------------------------------------------

    async def _on_forward(self, ws: web.WebSocketResponse, owned: set[str], data: bytes) -> None:
        try:
            frame = decode_forward(data, self.max_frame_bytes)
        except FrameError as exc:
            self.metrics.frame("in", "fwd_bad", len(data))
            await self._error(ws, exc.sid if exc.sid in owned else None, None, f"bad frame: {exc}", "bad_frame")
            return
        self.metrics.frame("in", f"fwd_{frame.mode}", frame.wire_bytes)
        sid = frame.sid
        session = self.sessions.get(sid) if sid in owned else None
        if session is None:
            await self._error(ws, sid, frame.step, f"unknown session {sid}: send open first", "unknown_session")
            return
        if session.busy:
            await self._error(ws, sid, frame.step, "a step of this session is already running", "bad_frame")
            return
        session.busy = True
        started = time.perf_counter()
        try:
            result = await self._compute(session, frame)
        except KVCacheMiss as exc:
            session.cache_misses += 1
            self.metrics.cache_misses.inc()
            await self._send(ws, CacheMiss(sid, frame.step, str(exc)))
            return
        except (ValueError, CacheBudgetExceeded) as exc:
            await self._error(ws, sid, frame.step, f"{self.node_name}: {exc}", "bad_step")
            return
        except Exception as exc:  # the node stays up whatever the model raises
            self.log_limit.log(type(exc).__name__, logging.ERROR, "step of session %s failed", sid[:12], exc_info=exc)
            await self._error(ws, sid, frame.step, f"{self.node_name}: {type(exc).__name__}: {exc}", "compute")
            return
        finally:
            session.busy = False
        self._count_step(session, frame, time.perf_counter() - started)
        if self.sessions.get(sid) is not session:  # closed while the step ran: drop what it stored
            await self.worker.call(self.backend.release_session, sid)
            return
        await self._deliver(ws, session, frame, result)

    async def _compute(self, session: InboundSession, frame: ForwardFrame) -> StepResult:
        if frame.ids is not None and frame.mode == "prefill":
            session.history = list(frame.ids)
        history = session.history or ()
        if frame.mode == "decode" and frame.shape[-2:-1] == (1,):
            step = DecodeStep(session.sid, body=frame.body, shape=frame.shape, dtype=frame.dtype,
                              past_len=frame.past_len, sampling=session.sampling, history=history,
                              generated_from=session.prompt_tokens)
            return await self.worker.decode(step)
        return await self.worker.call(
            self.backend.forward_bytes, frame.body, list(frame.shape), dtype=frame.dtype, session_id=session.sid,
            cache_mode=frame.mode, past_len=frame.past_len, sampling=session.sampling, history=history,
            generated_from=session.prompt_tokens,
        )

    def _count_step(self, session: InboundSession, frame: ForwardFrame, elapsed: float) -> None:
        session.compute_seconds += elapsed
        self.metrics.steps.labels(frame.mode).inc()
        self.metrics.step_seconds.labels(frame.mode).observe(elapsed)
        if frame.mode == "prefill":
            session.prefills += 1
            return
        session.decodes += 1
        count = self.note_decode_step(session.sid)
        if count is not None:
            log.debug("session %s: %d decode steps, past_len %d", session.sid[:12], count, frame.past_len)

    async def _deliver(self, ws: web.WebSocketResponse, session: InboundSession, frame: ForwardFrame,
                       result: StepResult) -> None:
        sid, step = session.sid, frame.step
        if isinstance(result, TailTokenResult):
            if session.history is not None and result.token_id is not None:
                session.history.append(result.token_id)
            text = result.text if result.text or result.token_id is None else None  # a legacy tail: text only
            await self._send(ws, Token(sid, step, result.token_id, text))
            return
        if session.next_hop is None:
            await self._error(ws, sid, step, f"{self.node_name}: no next hop for the hidden states", "link")
            return
        problem = await session.forwarding if session.forwarding is not None else None
        if problem:
            await self._error(ws, sid, step, problem, "link")
            return
        data = encode_forward(sid, step, frame.mode, result.past_len, result.shape, result.dtype, result.body,
                              ids=list(frame.ids) if frame.ids is not None else None,
                              compress_min_bytes=self.compress_min_bytes)
        try:
            await session.next_hop.send_forward(data)
            self.metrics.frame("out", f"fwd_{frame.mode}", len(data))
        except LinkDown as exc:
            await self._error(ws, sid, step, f"{self.node_name}: next hop unreachable: {exc}", "link")

    # -- sending ------------------------------------------------------------

    async def _error(self, ws: web.WebSocketResponse, sid: str | None, step: int | None, text: str,
                     kind: str) -> None:
        self.metrics.errors.labels(kind).inc()
        await self._send(ws, Error(text, sid, step))

    async def _send(self, ws: web.WebSocketResponse, message: ControlMessage) -> None:
        if ws.closed:
            return
        text = encode_control(message)
        try:
            await ws.send_str(text)
            self.metrics.frame("out", message.type, len(text))
        except (ConnectionError, RuntimeError):
            pass  # the link is going away; its sessions are released when the loop ends

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coroutine)
        self.pending_tasks.add(task)
        task.add_done_callback(self.pending_tasks.discard)

    async def shutdown(self) -> None:
        for ws in list(self.inbound):
            await ws.close(code=1001, message=b"node shutting down")
        for task in list(self.pending_tasks):
            task.cancel()

