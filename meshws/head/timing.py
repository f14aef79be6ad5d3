"""Where an answer's time goes: the head's layers, each shard's part, and the links between.

Every shard reports its part of a step on the answer's way back (`wire.HopReport`: time
on the shard, positions its cache holds after the step); the head times its own layers
and the whole lap, so the links' share (network, frames, queueing on the wire) is what
is left. `trace`, when asked for, keeps every lap: what it carried and each cache's
length after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

MAX_TRACE_LAPS = 4096
MAX_HOPS_KEPT = 32  # hops an answer's sums name (a route has a few; a peer could send many names)


@dataclass
class LapTimes:
    laps: int = 0
    head_ms: float = 0.0
    hop_ms: dict[str, float] = field(default_factory=dict)  # node -> time on it, in route order
    network_ms: float = 0.0
    link_ms: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> time on that link
    loads: dict[str, int] = field(default_factory=dict)  # node -> sessions it carried, as its last report said
    busy: dict[str, float] = field(default_factory=dict)  # node -> its busy share, as its last report said
    trace: list[dict[str, Any]] | None = None  # per lap, when asked for

    def record(self, *, positions: int, tokens: int, lap_ms: float, head_ms: float, head_cache: int,
               hops: Sequence[Any]) -> None:
        """One lap that worked: `positions` sent through, `tokens` it yielded, `hops` the shards' reports."""
        self.laps += 1
        self.head_ms += head_ms
        shards_ms = 0.0
        for hop in hops:
            if hop.node in self.hop_ms or len(self.hop_ms) < MAX_HOPS_KEPT:  # (names come from peers)
                self.hop_ms[hop.node] = self.hop_ms.get(hop.node, 0.0) + hop.ms
                if hop.load is not None:
                    self.loads[hop.node] = hop.load
                if hop.busy is not None:
                    self.busy[hop.node] = hop.busy
            shards_ms += hop.ms
        self.network_ms += max(0.0, lap_ms - head_ms - shards_ms)
        for link, ms in links_of(lap_ms - head_ms, hops):
            if link in self.link_ms or len(self.link_ms) < MAX_HOPS_KEPT:
                self.link_ms[link] = self.link_ms.get(link, 0.0) + ms
        if self.trace is not None and len(self.trace) < MAX_TRACE_LAPS:
            self.trace.append({
                "positions": positions, "tokens": tokens, "ms": round(lap_ms, 3),
                "hops": [{"node": "head", "ms": round(head_ms, 3), "cache_len": head_cache}]
                + [hop.to_wire() for hop in hops],
            })

    def view(self, name: Any = str) -> dict[str, Any]:
        """The breakdown as `/ws/chat` and the page show it; `name` maps node names for the public."""
        per_lap = 1 / self.laps if self.laps else 0.0
        view: dict[str, Any] = {
            "laps": self.laps,
            "head_ms": round(self.head_ms, 2),
            "hops": [{"node": name(node), "ms": round(ms, 2)} for node, ms in self.hop_ms.items()],
            "network_ms": round(self.network_ms, 2),
            "links": [{"from": name(a), "to": name(b), "ms": round(ms, 2)} for (a, b), ms in self.link_ms.items()],
            "per_lap_ms": {"head": round(self.head_ms * per_lap, 3), "network": round(self.network_ms * per_lap, 3),
                           "shards": round(sum(self.hop_ms.values()) * per_lap, 3)},
        }
        if self.trace is not None:
            view["trace"] = [{**lap, "hops": [{**hop, "node": name(hop["node"])} for hop in lap["hops"]]}
                             for lap in self.trace]
        return view


class RecentLaps:
    """What the last answers found on the route, for `/health` and the page's route diagram: each
    link's share of a lap and each shard's load (sessions) and busy share, with their age."""

    def __init__(self, limit: int = MAX_HOPS_KEPT) -> None:
        self.limit = limit
        self.links: dict[tuple[str, str], tuple[float, float]] = {}  # (from, to) -> (ms per lap, when)
        self.loads: dict[str, tuple[int, float | None, float]] = {}  # node -> (sessions, busy share, when)

    def note(self, times: LapTimes) -> None:
        now = time.monotonic()
        for link, ms in times.link_ms.items():
            self._put(self.links, link, (ms / max(1, times.laps), now))
        for node, load in times.loads.items():
            self._put(self.loads, node, (load, times.busy.get(node), now))

    def _put(self, table: dict, key: Any, value: Any) -> None:
        table.pop(key, None)  # the newest last: past the limit, the oldest go first
        table[key] = value
        while len(table) > self.limit:
            del table[next(iter(table))]

    def view(self) -> dict[str, list[dict[str, Any]]]:
        now = time.monotonic()
        return {"links": [{"from": a, "to": b, "lap_ms": round(ms, 2), "age_s": round(now - when, 1)}
                          for (a, b), (ms, when) in self.links.items()],
                "loads": [{"node": node, "sessions": load, "busy": busy, "age_s": round(now - when, 1)}
                          for node, (load, busy, when) in self.loads.items()]}


def links_of(wait_ms: float, hops: Sequence[Any]) -> list[tuple[tuple[str, str], float]]:
    """Each link's share of a lap the head waited `wait_ms` for, from the hops' reports.

    A hop that sent the step on reports how long the rest took from there (`wait_ms`), so
    the link into hop i is what the hop before it waited, less hop i's own time and wait.
    A hop that does not say (an older node) leaves the rest of the route as one link.
    """
    links, before = [], "head"
    for index, hop in enumerate(hops):
        last = index == len(hops) - 1
        after = 0.0 if last else hop.wait_ms
        if after is None:
            rest = sum(other.ms for other in hops[index:])
            links.append(((before, hops[-1].node), max(0.0, wait_ms - rest)))
            break
        links.append(((before, hop.node), max(0.0, wait_ms - hop.ms - after)))
        wait_ms, before = after, hop.node
    return links
