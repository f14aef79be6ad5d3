"""What a shard keeps of each inbound link and each session on it, its limits, its log throttle, and the hellos
that open a link."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import WSMsgType, web

from ..model.text.sampling_params import SamplingParams
from .link import Link
from .log_limit import LogLimiter
from .wire import ControlMessage, Error, FrameError, Hello, HopReport, RouteHop, decode_control

DECODE_LOG_INTERVAL = 5.0  # seconds between one session's decode summary lines
LINK_SESSIONS = 256  # sessions one inbound link may carry at once
LINK_FRAMES = 256  # tensor frames of one inbound link being inflated, computed or sent on at once
STEP_TIMEOUT = 120.0  # seconds the head waits for a step; a middle waits less, by the hops behind it
HELLO_WAIT = 15.0  # seconds a dialer has to send its hello


@dataclass(frozen=True)
class ShardLimits:
    """Per-link caps of a shard, and how long a middle waits for its next hop's answer."""

    link_sessions: int = LINK_SESSIONS
    link_frames: int = LINK_FRAMES
    step_timeout: float = STEP_TIMEOUT

    def hop_timeout(self, hops_behind: int) -> float:
        """How long a middle with `hops_behind` hops after it waits for an answer: less than the hop before.

        The head waits `step_timeout`; each hop nearer the tail waits a smaller share, so
        the hop nearest to one that hangs speaks first and names it.
        """
        return self.step_timeout * hops_behind / (hops_behind + 1)


class InboundLink:
    """One websocket from the hop before: its sessions and its in-flight tensor frames."""

    def __init__(self, ws: web.WebSocketResponse, peer: str, limits: ShardLimits) -> None:
        self.ws = ws
        self.peer = peer
        self.owned: set[str] = set()  # sessions opened over this link
        self.copies: set[str] = set()  # sessions whose standby copies this link feeds (`mesh.standby`)
        self.limits = limits
        self.frame_slots = asyncio.Semaphore(limits.link_frames)


@dataclass
class InboundSession:
    sid: str
    sampling: SamplingParams
    prompt_tokens: int | None  # where generated tokens start (for the OpenAI-style penalties)
    next_hop: Link | None
    route: tuple[RouteHop, ...]  # hops after the next one
    link: InboundLink | None = None  # the link it came over
    history: list[int] | None = None  # token ids so far, kept only when sampling needs them
    forwarding: asyncio.Future | None = None  # `open` on its way to the next hop: None = sent, else why not
    after: asyncio.Future | None = None  # the release of an earlier session of this id: steps wait for it
    step_task: asyncio.Task | None = None  # the step running now
    waiting: tuple[int, asyncio.TimerHandle] | None = None  # (step, timer) while the next hop owes an answer
    busy: bool = False
    hold: bool = False  # the hop before has a standby: a dropped link leaves the cache as a copy (`mesh.standby`)
    prefills: int = 0
    decodes: int = 0
    cache_misses: int = 0
    compute_seconds: float = 0.0
    report: tuple[int, HopReport] | None = None  # (step, this shard's part of it) for the answer coming back
    sent: tuple[int, float] | None = None  # (step, perf_counter) when it went on to the next hop
    opened: float = field(default_factory=time.monotonic)


class DecodeLogThrottle:
    """Per-session decode logging: the first step, then at most one line per interval."""

    def __init__(self, interval: float = DECODE_LOG_INTERVAL) -> None:
        self.interval = interval
        self._steps: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def note(self, sid: str, now: float) -> int | None:
        """Count a decode step; returns the session's step count when a line is due."""
        steps = self._steps.get(sid, 0) + 1
        self._steps[sid] = steps
        last = self._last.get(sid)
        if last is None or now - last >= self.interval:
            self._last[sid] = now
            return steps
        return None

    def forget(self, sid: str) -> None:
        self._steps.pop(sid, None)
        self._last.pop(sid, None)


async def handshake(ws: Any, remote: str, hello: Callable[[], Hello], log_limit: LogLimiter,
                    send: Callable[[Any, ControlMessage], Awaitable[None]]) -> str | None:
    """The dialer's hello first; ours (`hello()`) in answer. The dialer's node name, or None (and the link closed)
    when it does not fit."""
    try:
        message = await ws.receive(timeout=HELLO_WAIT)
        if message.type != WSMsgType.TEXT:
            raise FrameError("the first frame must be a hello text frame")
        theirs = decode_control(message.data)
        if not isinstance(theirs, Hello):
            raise FrameError(f"the first frame must be hello, not {theirs.type}")
        mine = hello()
        if theirs.model != mine.model:
            raise FrameError(f"this node serves model {mine.model!r}, not {theirs.model!r}")
    except (FrameError, asyncio.TimeoutError) as exc:
        reason = str(exc) or f"no hello within {HELLO_WAIT:.0f} s"
        log_limit.log("refused link", logging.WARNING, "refused link from %s: %s", remote, reason)
        await send(ws, Error(message=f"link refused: {reason}"))
        await ws.close(code=1008, message=reason[:120].encode())
        return None
    await send(ws, hello())
    return theirs.node
