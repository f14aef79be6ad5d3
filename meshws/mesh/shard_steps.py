"""The tensor frames (`fwd`) of a shard's inbound links: checked, run on the compute worker, sent on.

A frame's header is checked on the read loop before anything else happens to it: the
session must be open on this link and idle, the shape must be `[1, n, hidden]`,
`past_len + n` must fit the model's context and token ids its vocabulary. Only then
does the frame take one of the link's in-flight slots (when all are taken, the read
loop waits a moment — backpressure — and then refuses the frame), and its body is
inflated (off the event loop when large) and run as a task. A step for a session that
closes meanwhile is cancelled: the worker skips what is left of it.

On a middle, the answer to a forwarded step comes back over the next hop's link; if it
does not come within the hop's timeout, the hop before hears `Error(lost=True, url=
<next hop>)`, so the head avoids the hop that hung.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Coroutine

from ..model.backend import DecodeStep, PrefillStep, ShardBackend, StepResult, TailTokenResult
from ..model.kv.cache_store import CacheBudgetExceeded, KVCacheMiss
from .compute import ComputeWorker
from .inbound import DecodeLogThrottle, InboundLink, InboundSession, ShardLimits
from .link import LinkDown
from .log_limit import LogLimiter
from .metrics import NodeMetrics
from .wire import (
    CacheMiss,
    ControlMessage,
    Error,
    ForwardFrame,
    ForwardHeader,
    FrameError,
    HopReport,
    Token,
    inflate_forward,
    inflate_rows,
    read_forward_headers,
)

log = logging.getLogger("meshws.shard_service")

SLOT_WAIT = 1.0  # seconds the read loop waits for a free in-flight slot before refusing a frame
OFF_LOOP_BYTES = 1 << 20  # bodies at least this large are inflated and copied off the event loop
# Bytes the compressed frames of steps in flight may hold inflated, node-wide: a few KB of zstd can declare 64 MiB, so a
# peer holding the secret could otherwise make a node hold GBs (a prefill chunk needs about 1 MiB)
INFLATED_BUDGET = 512 << 20

Send = Callable[[InboundLink, ControlMessage], Coroutine[Any, Any, None]]
Refuse = Callable[[InboundLink, str | None, int | None, str, str], Coroutine[Any, Any, None]]


class ShardSteps:
    def __init__(self, backend: ShardBackend, worker: ComputeWorker, metrics: NodeMetrics,
                 sessions: dict[str, InboundSession], limits: ShardLimits, *, node_name: str, max_frame_bytes: int,
                 compress_min_bytes: int, send: Send, refuse: Refuse,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task]) -> None:
        self.backend = backend
        self.worker = worker
        self.metrics = metrics
        self.sessions = sessions
        self.limits = limits
        self.node_name = node_name
        self.max_frame_bytes = max_frame_bytes
        self.compress_min_bytes = compress_min_bytes
        self._send = send
        self._refuse = refuse
        self._spawn = spawn
        self.decode_log = DecodeLogThrottle()
        self.moved_away: dict[str, None] = {}  # sessions a move of this node's layers ended (`ShardService.move`)
        self.url: str | None = None  # this node's advertised address
        self.inflated_bytes = 0  # what the compressed frames of steps in flight hold once inflated (all links)
        self.feeds: Any = None  # the sessions' standby feeds (`mesh.standby.Feeds`), told of every step
        self.log_limit = LogLimiter(log)

    # -- on the read loop -----------------------------------------------------

    async def accept(self, link: InboundLink, data: bytes) -> None:
        """Check a frame's header and start its step, or each step of a wave's frame; never waits for compute."""
        try:
            headers = read_forward_headers(data, self.max_frame_bytes)
        except FrameError as exc:
            self.metrics.frame("in", "fwd_bad", len(data))
            await self._refuse(link, exc.sid if exc.sid in link.owned else None, None, f"bad frame: {exc}",
                               "bad_frame")
            return
        if headers[0].rows == 1:
            self.metrics.frame("in", f"fwd_{headers[0].mode}", headers[0].wire_bytes)
            await self._accept_step(link, headers[0], data, None)
            return
        self.metrics.frame("in", "fwd_wave", len(data))
        strangers = [header.sid for header in headers if header.sid not in link.owned]
        if strangers:  # one error for them all: a frame's rows never come back as as many error frames
            await self._refuse(link, None, None, f"{len(strangers)} rows of a wave's frame for sessions not open "
                               f"on this link (first {strangers[0][:32]}): send open first", "unknown_session")
        taken = []  # rows checked before the body is touched (nothing is inflated for a frame none of it fits)
        for header in (header for header in headers if header.sid in link.owned):
            problem = f"bad frame: {header.problem}" if header.problem is not None else self.header_problem(header)
            if problem:
                await self._refuse(link, header.sid, header.step, problem, "bad_frame")
            else:
                taken.append(header)
        if not taken:
            return
        try:  # (one body for every row: inflated and checked once, off the event loop when large)
            frames = await asyncio.to_thread(inflate_rows, headers, data) \
                if headers[0].body_bytes * headers[0].rows >= OFF_LOOP_BYTES else inflate_rows(headers, data)
        except FrameError as exc:
            sids = ", ".join(header.sid[:32] for header in taken[:4])
            await self._refuse(link, None, None, f"bad frame: {exc} (rows of {sids}...)", "bad_frame")
            return
        del data
        for header in taken:  # each row as the step it would have been alone
            await self._accept_step(link, header, None, frames[header.row])

    async def _accept_step(self, link: InboundLink, header: ForwardHeader, data: bytes | None,
                           frame: ForwardFrame | None) -> None:
        """One step: its session must be open on this link and idle, its header fit; then it takes a slot."""
        sid = header.sid
        session = self.sessions.get(sid) if sid in link.owned else None
        if session is None and sid in self.moved_away:  # (a step sent before its hop heard the move: lost too)
            await self._lost(link, sid, header.step, f"{self.node_name}: its layers moved; route around it",
                             self.url or "")
            return
        if session is None:
            await self._refuse(link, sid, header.step, f"unknown session {sid}: send open first", "unknown_session")
            return
        if session.busy:
            await self._refuse(link, sid, header.step, "a step of this session is already running", "bad_frame")
            return
        problem = self.header_problem(header)
        if problem:
            await self._refuse(link, sid, header.step, f"{self.node_name}: {problem}", "bad_step")
            return
        session.busy = True
        try:
            await asyncio.wait_for(link.frame_slots.acquire(), SLOT_WAIT)
        except asyncio.TimeoutError:
            session.busy = False
            await self._refuse(link, sid, header.step, f"{self.node_name}: this link already has "
                               f"{self.limits.link_frames} frames in flight; try again", "link_busy")
            return
        if self.sessions.get(sid) is not session:  # ended (closed, re-opened elsewhere) while the frame waited
            link.frame_slots.release()
            session.busy = False
            return
        task = session.step_task = self._spawn(self._step(link, session, header, data, frame))
        task.add_done_callback(lambda done: self._step_over(link, session, done))

    @staticmethod
    def _step_over(link: InboundLink, session: InboundSession, task: asyncio.Task) -> None:
        """A step ended (done, failed, or cancelled — even before it started): its slot is free again."""
        link.frame_slots.release()
        if session.step_task is task:
            session.step_task = None
            session.busy = False

    def header_problem(self, header: ForwardHeader) -> str | None:
        """What makes a frame's header unfit for this shard (before its body is touched), or None."""
        hidden = self.backend.hidden_size
        if len(header.shape) != 3 or header.shape[0] != 1 or header.shape[2] != hidden:
            return f"hidden states must have shape [1, tokens, {hidden}], got {list(header.shape)}"
        start = header.past_len if header.mode == "decode" else 0
        context = self.backend.context_length
        if start + header.positions > context:
            return f"past_len {start} + {header.positions} positions exceed the context of {context} tokens"
        vocab = self.backend.vocab_size
        if header.ids is not None:
            if len(header.ids) > context:
                return f"{len(header.ids)} token ids exceed the context of {context} tokens"
            if any(token >= vocab for token in header.ids):
                return f"a token id is outside the vocabulary [0, {vocab})"
        if any(token >= vocab for token in header.drafts):
            return f"a draft token id is outside the vocabulary [0, {vocab})"
        return None

    # -- the step, as a task ---------------------------------------------------

    async def _step(self, link: InboundLink, session: InboundSession, header: ForwardHeader, data: bytes | None,
                    frame: ForwardFrame | None) -> None:
        """The step (its frame, or a wave's row `frame` already inflated) computed, and its result sent on."""
        sid, started = session.sid, time.perf_counter()
        charge = header.body_bytes if frame is None and header.enc else 0  # (a small body inflating to a big one)
        if charge and self.inflated_bytes + charge > INFLATED_BUDGET:
            await self._refuse(link, sid, header.step, f"{self.node_name}: compressed frames in flight would hold "
                               f"over {INFLATED_BUDGET >> 20} MiB inflated; try again", "link_busy")
            return
        self.inflated_bytes += charge
        try:
            if session.after is not None:
                await asyncio.wait({session.after})  # an earlier session of this id is released first
            if frame is None:
                frame = await self._inflated(link, header, data or b"")
                if frame is None:
                    return
            del data
            result = await self._compute(session, frame)
        except KVCacheMiss as exc:
            session.cache_misses += 1
            self.metrics.cache_misses.inc()
            await self._send(link, CacheMiss(sid=sid, step=header.step, reason=str(exc)))
            return
        except (ValueError, CacheBudgetExceeded) as exc:
            await self._refuse(link, sid, header.step, f"{self.node_name}: {exc}", "bad_step")
            return
        except Exception as exc:  # the node stays up whatever the model raises
            self.log_limit.log(type(exc).__name__, logging.ERROR, "step of session %s failed", sid[:12], exc_info=exc)
            await self._refuse(link, sid, header.step, f"{self.node_name}: {type(exc).__name__}: {exc}", "compute")
            return
        finally:
            session.busy = False  # (the slot is freed when the task ends: `_step_over`)
            self.inflated_bytes -= charge
        self._count_step(session, frame, time.perf_counter() - started)
        if self.sessions.get(sid) is not session:  # closed while the step ran: drop what it stored
            await self.worker.release(sid)
            return
        await self._deliver(link, session, frame, result)

    async def _inflated(self, link: InboundLink, header: ForwardHeader, data: bytes) -> ForwardFrame | None:
        """The frame's body inflated and checked (off the event loop when large), or None: refused."""
        try:
            if header.body_bytes >= OFF_LOOP_BYTES or len(data) >= OFF_LOOP_BYTES:
                return await asyncio.to_thread(inflate_forward, header, data)
            return inflate_forward(header, data)
        except FrameError as exc:
            await self._refuse(link, header.sid, header.step, f"bad frame: {exc}", "bad_frame")
            return None

    async def _compute(self, session: InboundSession, frame: ForwardFrame) -> StepResult:
        if frame.ids is not None:  # a prefill, or a conversation's next turn: the token ids so far
            session.history = list(frame.ids)
        history = session.history or ()
        if frame.mode == "decode" and frame.shape[-2:-1] == (1,):  # (a step with drafts has more positions)
            step = DecodeStep(session.sid, body=frame.body, shape=frame.shape, dtype=frame.dtype,
                              past_len=frame.past_len, sampling=session.sampling, history=history,
                              generated_from=session.prompt_tokens, group=frame.group)
            return await self.worker.decode(step)
        return await self.worker.prefill(PrefillStep(
            session.sid, body=frame.body, shape=frame.shape, dtype=frame.dtype, mode=frame.mode,
            past_len=frame.past_len, sampling=session.sampling, history=history,
            generated_from=session.prompt_tokens, drafts=frame.drafts,
        ))

    def _count_step(self, session: InboundSession, frame: ForwardFrame, elapsed: float) -> None:
        session.compute_seconds += elapsed
        held = self.backend.sessions.held(session.sid)
        standby = self.feeds.held(session.sid) if self.feeds is not None else None
        busy = self.metrics.busy.now() if self.metrics.busy is not None else None
        session.report = (frame.step, HopReport(node=self.node_name, ms=elapsed * 1000, cache_len=held,
                                                load=len(self.sessions), standby=standby, busy=busy))
        if self.feeds is not None:
            self.feeds.stepped(session.sid)
        self.metrics.steps.labels(frame.mode).inc()
        self.metrics.step_seconds.labels(frame.mode).observe(elapsed)
        if frame.mode == "prefill":
            session.prefills += 1
            return
        session.decodes += 1
        count = self.decode_log.note(session.sid, time.monotonic())
        if count is not None:
            log.debug("session %s: %d decode steps, past_len %d", session.sid[:12], count, frame.past_len)

    async def _deliver(self, link: InboundLink, session: InboundSession, frame: ForwardFrame,
                       result: StepResult) -> None:
        sid, step = session.sid, frame.step
        if isinstance(result, TailTokenResult):
            if session.history is not None and result.token_id is not None:
                session.history.extend(result.token_ids or (result.token_id,))
            text = result.text if result.text or result.token_id is None else None  # a legacy tail: text only
            await self._send(link, Token(sid=sid, step=step, token_id=result.token_id, text=text,
                                         token_ids=result.token_ids, hops=self.own_report(session, step),
                                         logprobs=result.logprobs,
                                         prompt_logprobs=result.prompt_logprobs))
            return
        next_hop = session.next_hop
        if next_hop is None:
            await self._refuse(link, sid, step, f"{self.node_name}: no next hop for the hidden states", "link")
            return
        problem = await session.forwarding if session.forwarding is not None else None
        if problem:
            await self._lost(link, sid, step, problem, next_hop.url)
            return
        try:
            if frame.mode == "decode" and frame.shape[1] == 1:
                self._expect_answer(link, session, step)
            else:  # a prefill's time grows with its length and the load behind us: the head's timeout judges it
                self.answered(session)
            session.sent = (step, time.perf_counter())
            size = await next_hop.send_step(sid, step, frame.mode, result, list(frame.ids) if frame.ids is not None
                                            else None, frame.drafts, self.compress_min_bytes)  # (a row: with its wave)
            self.metrics.frame("out", f"fwd_{frame.mode}", size)
        except LinkDown as exc:
            self.answered(session)
            await self._lost(link, sid, step, f"{self.node_name}: next hop unreachable: {exc}", next_hop.url)

    @staticmethod
    def own_report(session: InboundSession, step: int | None) -> tuple[HopReport, ...]:
        """This shard's part of `step`, for the answer on its way back (none if it did not run it)."""
        report, session.report = session.report, None
        sent, session.sent = session.sent, None
        if report is None or report[0] != step:
            return ()
        if sent is not None and sent[0] == step:  # how long the rest of the route took, as seen from here
            return (replace(report[1], wait_ms=(time.perf_counter() - sent[1]) * 1000),)
        return (report[1],)

    # -- waiting for the next hop ------------------------------------------------

    def _expect_answer(self, link: InboundLink, session: InboundSession, step: int) -> None:
        """Start the clock on the next hop's answer to `step`."""
        self.answered(session)
        timeout = self.limits.hop_timeout(self._hops_behind(session))
        loop = asyncio.get_running_loop()
        session.waiting = (step, loop.call_later(timeout, self._hung, link, session, step, timeout))

    @staticmethod
    def _hops_behind(session: InboundSession) -> int:
        """Hops after this node: the route's, or on a static chain what the next hop's hello says."""
        if session.route:
            return len(session.route) + 1
        hello = session.next_hop.peer_hello if session.next_hop is not None else None
        return max(1, len(hello.chain)) if hello is not None else 1

    def answered(self, session: InboundSession, step: int | None = None) -> None:
        """The next hop answered (`step`, or whatever it was waiting for), or the session ended: stop the clock."""
        if session.waiting is not None and (step is None or session.waiting[0] == step):
            session.waiting[1].cancel()
            session.waiting = None

    def _hung(self, link: InboundLink, session: InboundSession, step: int, timeout: float) -> None:
        session.waiting = None
        if self.sessions.get(session.sid) is not session or session.next_hop is None:
            return
        url = session.next_hop.url
        message = f"{self.node_name}: no answer from the next hop {url} within {timeout:.0f} s"
        self._spawn(self._lost(link, session.sid, step, message, url))

    async def _lost(self, link: InboundLink, sid: str, step: int | None, message: str, url: str) -> None:
        """The next hop is gone or hung: the head re-routes around `url` (that hop, not this node)."""
        self.metrics.errors.labels("link").inc()
        await self._send(link, Error(message=message, sid=sid, step=step, lost=True, url=url))
