"""The head's registry of joined nodes, and which span a `--layers auto` node should take.

Nodes started with `--join` announce themselves to the head (endpoint, model,
layers, free cache capacity, load) and repeat it as a heartbeat; a node not
heard from for `ttl` seconds is dropped, whoever notices first (the expiry loop, or a
read such as `nodes()`), and every drop is told to `on_expire` (the head closes its link
and logs it), so a dead node is never re-dialed nor shown. `--layers auto`: a joining node takes the
first span no node serves (the whole gap); when every layer is served, it
replicates the least-served span that some node already serves (fewest replicas,
then the lowest layers). Spans handed out are reserved for a while so nodes
joining together spread out.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from .routes import NodeRecord, NoRoute

MAX_RESERVED_PER_SPAN = 8  # --layers auto grants remembered per span (more askers share the last answer)


class Registry:
    def __init__(self, model: str, total_layers: int, ttl: float = 6.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_expire: Callable[[NodeRecord], None] = lambda record: None) -> None:
        self.model = model
        self.total_layers = total_layers
        self.ttl = ttl
        self.on_expire = on_expire  # told of every record dropped for silence, once
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
        """The nodes heard from within the TTL; the others expire now (and `on_expire` hears of each)."""
        self.expire()
        return sorted(self._nodes.values(), key=lambda r: (r.layers, r.url))

    def urls(self) -> list[str]:
        return [record.url for record in self.nodes()]

    def expire(self) -> list[NodeRecord]:
        """Drop the nodes not heard from within the TTL, telling `on_expire` of each; which they were."""
        now = self._clock()
        gone = [r for r in self._nodes.values() if not r.static and now - r.last_seen > self.ttl]
        for record in gone:
            del self._nodes[record.url]
        for record in gone:
            self.on_expire(record)
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
        grants = self._reserved.setdefault(span, [])
        if len(grants) < MAX_RESERVED_PER_SPAN:
            grants.append(self._clock() + reserve_seconds)
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
