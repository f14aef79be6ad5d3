"""The head's registry of joined nodes.

Nodes started with `--join` announce themselves to the head (endpoint, model,
layers, free cache capacity, load, measured speed and memory budget) and repeat it
as a heartbeat; a node not heard from for `ttl` seconds is dropped, whoever notices
first (the expiry loop, or a read such as `nodes()`), and every drop is told to
`on_expire` (the head closes its link and logs it), so a dead node is never re-dialed
nor shown. Which layers an automatic node serves is the placement's (`rebalance`).

A registration binds its URL to the node key its join proved (`head.membership`); the binding outlives a record
dropped for silence (or for a link that belied it) by BIND_GRACE seconds, so a member cannot take a node's URL in
the moment it restarts or its network blinks. A node that leaves ends its binding at once.
"""

from __future__ import annotations

import time
from typing import Callable

from .routes import NodeRecord

BIND_GRACE = 300.0  # seconds a silent node's URL stays bound to its key
LAPSED_MAX = 4096  # such bindings; while this many are kept, new URLs wait (none is dropped within its grace)


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
        self._lapsed: dict[str, tuple[str, float]] = {}  # URL -> (key, when its record went) for BIND_GRACE

    def announce(self, record: NodeRecord) -> None:
        if record.model != self.model:
            raise ValueError(f"this mesh serves model {self.model!r}, not {record.model!r}")
        start, end = record.layers
        if not 0 < start < end <= self.total_layers:
            raise ValueError(f"layers [{start}, {end}) do not fit after the head in {self.total_layers} layers")
        record.last_seen = self._clock()
        self._nodes[record.url] = record
        self._lapsed.pop(record.url, None)

    def leave(self, url: str, keep_binding: bool = False) -> bool:
        """Drop `url`'s record: its node left (its binding ends), or, `keep_binding`, the head dropped it."""
        record = self._nodes.pop(url, None)
        self._lapsed.pop(url, None)
        if record is not None and keep_binding:
            self._lapse(record)
        return record is not None

    def bound_key(self, url: str) -> str | None:
        """The node key `url` is bound to: a live registration's, or one that went silent within BIND_GRACE."""
        live = self.key_of(url)
        if live is not None:
            return live
        lapsed = self._lapsed.get(url)
        return lapsed[0] if lapsed is not None and self._clock() - lapsed[1] <= BIND_GRACE else None

    def _lapse(self, record: NodeRecord) -> None:
        if not record.key:
            return
        now = self._clock()
        self._lapsed[record.url] = (record.key, now)
        for url in [url for url, (_, when) in self._lapsed.items() if now - when > BIND_GRACE]:
            del self._lapsed[url]

    @property
    def crowded(self) -> bool:
        """So many silent URLs are still bound that a new one may not join (a flood of throwaway joins)."""
        return len(self._lapsed) >= LAPSED_MAX

    def nodes(self) -> list[NodeRecord]:
        """The nodes heard from within the TTL; the others expire now (and `on_expire` hears of each)."""
        self.expire()
        return sorted(self._nodes.values(), key=lambda r: (r.layers, r.url))

    def key_of(self, url: str) -> str | None:
        """The node key a live registration binds `url` to (`head.membership`); None if none lives."""
        record = self._nodes.get(url)
        return record.key if record is not None and record in self.nodes() else None

    def spans(self) -> dict[str, tuple[int, int]]:
        """Each joined node's layers, by URL."""
        return {record.url: record.layers for record in self.nodes()}

    def expire(self) -> list[NodeRecord]:
        """Drop the nodes not heard from within the TTL, telling `on_expire` of each; which they were."""
        now = self._clock()
        gone = [r for r in self._nodes.values() if not r.static and now - r.last_seen > self.ttl]
        for record in gone:
            del self._nodes[record.url]
            self._lapse(record)
        for record in gone:
            self.on_expire(record)
        return gone
