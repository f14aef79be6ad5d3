"""What a shard keeps of each session that came over an inbound link, and its log throttle."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..model.sampling import SamplingParams
from .link import Link
from .wire import RouteHop

DECODE_LOG_INTERVAL = 5.0  # seconds between one session's decode summary lines


@dataclass
class InboundSession:
    sid: str
    sampling: SamplingParams
    prompt_tokens: int | None  # where generated tokens start (for the OpenAI-style penalties)
    next_hop: Link | None
    route: tuple[RouteHop, ...]  # hops after the next one
    history: list[int] | None = None  # token ids so far, kept only when sampling needs them
    forwarding: asyncio.Future | None = None  # `open` on its way to the next hop: None = sent, else why not
    busy: bool = False
    prefills: int = 0
    decodes: int = 0
    cache_misses: int = 0
    compute_seconds: float = 0.0
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
