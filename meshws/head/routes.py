"""Route planning and chain coverage.

For each generation the head plans a route: hops whose spans chain exactly from
the end of its own layers to the last layer, fewest hops first, then the least
loaded. The head sends the hops after the first in `open`; each shard forwards
the rest. `chain_gaps` says, in inclusive layer numbers, what a chain lacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..mesh.identity import fingerprint
from ..mesh.link import Link
from ..mesh.wire import RouteHop


class NoRoute(Exception):
    """No chain of nodes covers the layers; the message names what is missing."""


@dataclass
class NodeRecord:
    url: str  # where its /ws/shard listens, ws://host:port
    node: str  # its name, role@host:port
    model: str
    layers: tuple[int, int]  # half-open
    role: str = "tail"
    capacity: int = 0  # free KV-cache sessions it reports
    load: int = 0  # sessions it holds now
    last_seen: float = field(default_factory=time.monotonic)
    static: bool = False  # the --peer chain (not joined; never expires)
    draining: bool = False  # shutting down: its sessions finish, new ones go elsewhere
    auto: bool = False  # placed by the head's plan (--layers auto); else its layers are its own (hand-placed)
    roles: tuple[str, ...] = ("middle", "tail")  # what an automatic node may become
    layer_seconds: float | None = None  # measured: seconds per mean layer per token (`model.speed`)
    lm_head_seconds: float | None = None  # measured on a tail: its LM head's seconds per token
    memory: int | None = None  # bytes of weights and KV caches it may hold (--memory)
    link_seconds: float = 0.0  # its heartbeat's round trip to this head
    busy: float | None = None  # the share of its last seconds spent computing, as its heartbeat said
    epoch: str = ""  # whose plan versions `serving` and `prepared` count (a head's, from its instructions)
    serving: int = 0  # the plan version an automatic node serves (0: none yet)
    prepared: int = 0  # the plan version whose span it has loaded beside the one it serves
    key: str = ""  # the node key its join proved (`mesh.identity`; "" without a mesh secret): bound to `url`

    def describe(self) -> dict[str, Any]:
        view = {"url": self.url, "node": self.node, "layers": list(self.layers), "role": self.role,
                "capacity": self.capacity, "load": self.load, "static": self.static, "draining": self.draining,
                "last_seen_s": round(time.monotonic() - self.last_seen, 1), "auto": self.auto,
                "fingerprint": fingerprint(self.key) if self.key else None}
        if self.layer_seconds is not None:
            view["measured"] = {"layer_ms": round(self.layer_seconds * 1000, 4), "memory": self.memory,
                                "link_ms": round(self.link_seconds * 1000, 3),
                                "lm_head_ms": None if self.lm_head_seconds is None else
                                round(self.lm_head_seconds * 1000, 4), "busy": self.busy}
        return view


@dataclass
class Route:
    link: Link | None  # the head's link to the first hop; None on a full node
    hops: tuple[RouteHop, ...] = ()  # hops after the first, sent in `open`
    view: list[dict[str, Any]] = field(default_factory=list)  # every node and its layers, for people
    urls: list[str] = field(default_factory=list)  # the hops' endpoints, first hop first
    layers: tuple[int, int] | None = None  # the first hop's span as planned (its `open` says so; None: --peer)
    standbys: tuple[str | None, ...] = ()  # each hop's: another node of its span that keeps the session's KV too
    on_done: Callable[[], None] | None = None  # set while a generation holds the route

    @property
    def first_standby(self) -> str | None:
        """The first hop's standby (the `open` names it; later hops' are in the route's hops)."""
        return self.standbys[0] if self.standbys else None

    def release(self) -> None:
        """The generation left this route (idempotent)."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done()


def plan_hops(
    records: list[NodeRecord],
    start: int,
    total_layers: int,
    load: Callable[[NodeRecord], float],
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    hop_cost: Callable[[NodeRecord | None, NodeRecord], float] = lambda before, record: 0.0,
) -> list[NodeRecord]:
    """The fewest hops that chain exactly from `start` to `total_layers`, least costly among equals: each node's
    load, and what reaching it from the hop before costs (`hop_cost`; None before the first: the head)."""
    best: dict[int, tuple[int, float, list[NodeRecord]]] = {start: (0, 0.0, [])}
    for position in range(start, total_layers):  # spans only move forward: positions in order suffice
        if position not in best:
            continue
        hops, cost, path = best[position]
        for record in records:
            if record.url in exclude or record.layers[0] != position:
                continue
            candidate = (hops + 1, cost + load(record) + hop_cost(path[-1] if path else None, record), path + [record])
            end = record.layers[1]
            if end not in best or candidate[:2] < best[end][:2]:
                best[end] = candidate
    if total_layers not in best:
        served = sorted({r.layers for r in records if r.url not in exclude})
        raise NoRoute("no route: " + "; ".join(chain_gaps_from(served, start, total_layers)))
    return best[total_layers][2]


def chain_gaps_from(spans: list[tuple[int, int]], start: int, total_layers: int) -> list[str]:
    """Which layers from `start` on no span can reach, in inclusive numbers."""
    reachable = {start}
    for position in range(start, total_layers):
        if position in reachable:
            reachable.update(end for s, end in spans if s == position)
    last = max(reachable)
    if last >= total_layers:
        return []
    following = min((s for s, _ in spans if s > last), default=total_layers)
    return [f"layers {last}-{following - 1} are not served"]


def chain_gaps(spans: list[tuple[int, int]], total_layers: int, start: int = 0) -> list[str]:
    """What is wrong with a chain of half-open spans meant to cover [start, total) in order.

    Each problem is said in inclusive layer numbers, as on the command line.
    """
    problems: list[str] = []
    position = start
    for span_start, end in spans:
        if span_start > position:
            problems.append(f"layers {position}-{span_start - 1} are not served")
        elif span_start < position:
            problems.append(f"layers {span_start}-{min(end, position) - 1} are served twice")
        position = max(position, end)
    if position < total_layers:
        problems.append(f"layers {position}-{total_layers - 1} are not served")
    return problems
