"""The head's registry of nodes, route planning, and chain coverage.

Nodes started with `--join` announce themselves to the head (endpoint, model,
layers, free cache capacity, load) and repeat it as a heartbeat; a node not
heard from for `ttl` seconds is dropped. For each generation the head plans a
route: hops whose spans chain exactly from the end of its own layers to the
last layer, fewest hops first, then the least loaded. The head sends the hops
after the first in `open`; each shard forwards the rest.

`--layers auto`: a joining node takes the first span no node serves (the whole
gap); when every layer is served, it replicates the least-served span that
some node already serves (fewest replicas, then the lowest layers). Spans
handed out are reserved for a while so nodes joining together spread out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .link import Link


@dataclass
class Route:
    link: Link | None  # the head's link to the first hop; None on a full node
    hops: list[dict[str, Any]] = field(default_factory=list)  # hops after the first, sent in `open`
    view: list[dict[str, Any]] = field(default_factory=list)  # every node and its layers, for people
    urls: list[str] = field(default_factory=list)  # the hops' endpoints, first hop first
    on_done: Callable[[], None] | None = None  # called once the generation leaves this route


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

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "node": self.node, "layers": list(self.layers), "role": self.role,
                "capacity": self.capacity, "load": self.load, "static": self.static,
                "last_seen_s": round(time.monotonic() - self.last_seen, 1)}


class NoRoute(Exception):
    """No chain of nodes covers the layers; the message names what is missing."""


class Registry:
    def __init__(self, model: str, total_layers: int, ttl: float = 6.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.total_layers = total_layers
        self.ttl = ttl
        self._clock = clock
        self._nodes: dict[str, NodeRecord] = {}
        self._reserved: dict[tuple[int, int], list[float]] = {}  # span -> expiry times of --layers auto grants

    def announce(self, record: NodeRecord) -> None:
        if record.model != self.model:
            raise ValueError(f"this mesh serves model {self.model!r}, not {record.model!r}")
        start, end = record.layers
        if not 0 < start < end <= self.total_layers:
            raise ValueError(f"layers [{start}, {end}) do not fit after the head in {self.total_layers} layers")
        record.last_seen = self._clock()
        self._nodes[record.url] = record
        grants = self._reserved.get(record.layers)
        if grants:
            grants.pop(0)

    def leave(self, url: str) -> bool:
        return self._nodes.pop(url, None) is not None

    def nodes(self) -> list[NodeRecord]:
        self.expire()
        return sorted(self._nodes.values(), key=lambda r: (r.layers, r.url))

    def expire(self) -> list[NodeRecord]:
        now = self._clock()
        gone = [r for r in self._nodes.values() if not r.static and now - r.last_seen > self.ttl]
        for record in gone:
            del self._nodes[record.url]
        for span in list(self._reserved):
            self._reserved[span] = [t for t in self._reserved[span] if t > now]
            if not self._reserved[span]:
                del self._reserved[span]
        return gone

    def assign(self, head_span: tuple[int, int], reserve_seconds: float = 120.0) -> tuple[int, int]:
        """The span a `--layers auto` node should take (see the module's docstring)."""
        counts = [0] * self.total_layers
        spans: set[tuple[int, int]] = set()
        for start, end in [head_span] + [r.layers for r in self.nodes()] + list(self._reserved_spans()):
            for layer in range(start, end):
                counts[layer] += 1
            if start > 0:
                spans.add((start, end))
        gap = _first_gap(counts)
        if gap is not None:
            span = gap
        elif spans:
            span = min(spans, key=lambda s: (min(counts[s[0]:s[1]]), s))
        else:
            raise NoRoute("the head serves every layer; there is nothing to take")
        self._reserved.setdefault(span, []).append(self._clock() + reserve_seconds)
        return span

    def _reserved_spans(self) -> Iterable[tuple[int, int]]:
        for span, grants in self._reserved.items():
            for _ in grants:
                yield span


def _first_gap(counts: list[int]) -> tuple[int, int] | None:
    start = next((i for i, n in enumerate(counts) if n == 0), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(counts)) if counts[i] > 0), len(counts))
    return start, end


def plan_hops(
    records: list[NodeRecord],
    start: int,
    total_layers: int,
    load: Callable[[NodeRecord], float],
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[NodeRecord]:
    """The fewest hops that chain exactly from `start` to `total_layers`, least loaded among equals."""
    best: dict[int, tuple[int, float, list[NodeRecord]]] = {start: (0, 0.0, [])}
    for position in range(start, total_layers):  # spans only move forward: positions in order suffice
        if position not in best:
            continue
        hops, cost, path = best[position]
        for record in records:
            if record.url in exclude or record.layers[0] != position:
                continue
            candidate = (hops + 1, cost + load(record), path + [record])
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
