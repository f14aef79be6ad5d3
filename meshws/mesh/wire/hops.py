"""Hop reports: each shard's part of a step, carried back to the head in the `token` answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import FrameError, int_field, name_field

MAX_STEP_MS = 86_400_000.0  # a day: no step of a hop's report takes longer
MAX_LOAD = 1_000_000  # sessions a report may claim (a shard's link cap is far below)


@dataclass(frozen=True)
class HopReport:
    """One shard's part of a step, added to the answer on its way back to the head: `ms` on the
    shard (its frame's arrival to its result, the compute worker's queue included), `cache_len`
    its cache's positions after it (0 if it keeps none), and on a shard that sent the step on,
    `wait_ms`: how long the answer took to come back (so the head can tell each link's share).
    """

    node: str
    ms: float
    cache_len: int
    wait_ms: float | None = None
    load: int | None = None  # sessions the shard carries now (the page's route diagram shows it)
    standby: int | None = None  # positions of the session its standby has confirmed holding (`mesh.standby`)
    busy: float | None = None  # the share of the last seconds the shard spent computing (`metrics.BusyShare`)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"node": self.node, "ms": round(self.ms, 3), "cache_len": self.cache_len}
        if self.wait_ms is not None:
            wire["wait_ms"] = round(self.wait_ms, 3)
        if self.load is not None:
            wire["load"] = self.load
        if self.standby is not None:
            wire["standby"] = self.standby
        if self.busy is not None:
            wire["busy"] = self.busy
        return wire

    @classmethod
    def parse(cls, data: Any) -> "HopReport":
        if not isinstance(data, dict):
            raise FrameError("each hop report must be an object")
        wait, busy = data.get("wait_ms"), data.get("busy")
        return cls(name_field(data, "node"), _number(data.get("ms"), "ms", MAX_STEP_MS),
                   int_field(data, "cache_len", 0),
                   None if wait is None else _number(wait, "wait_ms", MAX_STEP_MS),
                   min(int_field(data, "load", 0), MAX_LOAD) if data.get("load") is not None else None,
                   int_field(data, "standby", 0) if data.get("standby") is not None else None,
                   None if busy is None else _number(busy, "busy", 1.0))


def _number(value: Any, name: str, most: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= most:
        raise FrameError(f"a hop report's {name} must be a number in [0, {most:.0f}]")
    return float(value)
