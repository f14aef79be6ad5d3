"""The head's route planner: which nodes a new generation goes through, and how loaded each is.

Candidates are the joined nodes the head has a live link to, plus the `--peer`
chain (one static hop that covers the layers its hello's chain covers). While the
head places layers itself (`rebalance.Placement`: the head or a joined node runs
`--layers auto`), only the nodes of the plan in force serve, each on its planned span,
and while the plan changes a new route waits for it to settle. A route is
planned once per generation (and again only to go around a failed hop); while a
generation holds a route, each of its hops counts one more in flight, so
concurrent generations spread over replicas.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Callable

from ..mesh.link import Link
from ..mesh.link_pool import LinkPool
from ..mesh.reverse import cannot_dial
from ..mesh.wire import RouteHop
from .registry import Registry
from .routes import NodeRecord, NoRoute, Route, chain_gaps, plan_hops

if TYPE_CHECKING:
    from .rebalance import Placement

RELAYED_HOP_COST = 8.0  # a relayed hop, in generations in flight


class RoutePlanner:
    def __init__(self, name: str, span: Callable[[], tuple[int, int]], total_layers: int, model_id: str,
                 links: LinkPool, registry: Registry | None, static_peer: str | None, full: bool,
                 standbys: bool = False) -> None:
        self.name = name
        self._span = span  # the head's own layers (they move when the head places itself)
        self.placement: Placement | None = None  # set on a head whose registry places layers
        self.total_layers = total_layers
        self.model_id = model_id
        self.links = links
        self.registry = registry
        self.static_peer = static_peer
        self.full = full  # a full node runs every layer itself: zero hops
        self.standbys = standbys  # name a standby for each hop of a route where another node serves its layers
        self._inflight: dict[str, int] = {}  # generations routed through each hop, by URL

    @property
    def span(self) -> tuple[int, int]:
        return self._span()

    def plan(self, exclude: set[str] | None = None) -> Route:
        """The route of a new generation: fewest hops, then least loaded. NoRoute says why there is none."""
        own = {"node": self.name, "layers": list(self.span)}
        if self.full:
            return Route(None, (), [own])
        try:
            hops = plan_hops(self._candidates(), self.span[1], self.total_layers,
                             load=lambda r: self._inflight.get(r.url, 0) + r.load, exclude=exclude or set(),
                             hop_cost=self._hop_cost)
        except NoRoute as exc:
            problems = [str(exc)]
            link = self._peer_link()
            if link is not None and not link.is_up:
                problems.append(f"next hop {link.url} is {link.status()}")
            raise NoRoute("; ".join(problems)) from exc
        view: list[dict[str, Any]] = [own]
        for hop in hops:
            if hop.static:
                peer = self.links.get(hop.url).peer_hello
                view += [chain_hop.to_wire() for chain_hop in (peer.chain if peer else ())]
            else:
                view.append({"node": hop.node, "layers": list(hop.layers), "url": hop.url})
        avoid = {hop.url for hop in hops} | (exclude or set())
        standbys = tuple(self._standby_for(hop, avoid) for hop in hops)
        after = () if hops[0].static else tuple(RouteHop(url=h.url, layers=h.layers, standby=standby)
                                                for h, standby in zip(hops[1:], standbys[1:]))
        return Route(self.links.get(hops[0].url), after, view, [hop.url for hop in hops],
                     layers=None if hops[0].static else hops[0].layers, standbys=standbys)

    def standby_route(self, route: Route, index: int) -> Route | None:
        """The route a session resumes on when `route`'s hop `index` goes: the same hops, with that one's standby in
        its place; held. None when it has none, or the head cannot reach it now."""
        standby = route.standbys[index] if index < len(route.standbys) else None
        span = route.layers if index == 0 else route.hops[index - 1].layers
        if standby is None or not self.links.get(standby).is_up:
            return None
        record = next((r for r in self._candidates() if r.url == standby and r.layers == span), None)
        if record is None:
            return None
        view, urls = list(route.view), list(route.urls)
        view[index + 1], urls[index] = {"node": record.node, "layers": list(record.layers), "url": record.url}, standby
        standbys = route.standbys[:index] + (None,) + route.standbys[index + 1:]
        if index == 0:
            return self.hold(Route(self.links.get(standby), route.hops, view, urls, layers=record.layers,
                                   standbys=standbys))
        hops = list(route.hops)
        hops[index - 1] = RouteHop(url=standby, layers=record.layers)
        return self.hold(Route(route.link, tuple(hops), view, urls, layers=route.layers, standbys=standbys))

    def _standby_for(self, hop: NodeRecord, avoid: set[str]) -> str | None:
        """The least loaded other node of the hop's span that the head sees dialable; None where there is none."""
        if not self.standbys or hop.static:
            return None
        others = [r for r in self._candidates() if not r.static and r.layers == hop.layers and r.url not in avoid
                  and not cannot_dial(self.links, r.url)]
        best = min(others, key=lambda r: self._inflight.get(r.url, 0) + r.load, default=None)
        return best.url if best is not None else None

    async def plan_settled(self, sid: str, exclude: set[str] | None = None) -> Route:
        """`plan`; where the head places layers, once a move under way has ended, and waiting (up to the
        placement's SETTLE_WAIT) for a route while the plan re-forms around a node that went. With placement, a
        route through a node to avoid is taken when there is no other: the plan in force chose it."""
        placement = self.placement
        if placement is None or not placement.active:
            return self.plan(exclude)
        from .rebalance import SETTLE_WAIT

        deadline = time.monotonic() + SETTLE_WAIT
        with placement.waiting(sid):
            while True:
                await placement.wait_settled()
                try:
                    return self.plan(exclude)
                except NoRoute:
                    if exclude:
                        with suppress(NoRoute):
                            return self.plan()
                    if time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(0.25)

    def _hop_cost(self, before: NodeRecord | None, record: NodeRecord) -> float:
        """A hop the head relays (neither side can dial the other: `mesh.relay`) crosses the head's network twice:
        it counts as RELAYED_HOP_COST generations more, so a direct or reversed replica goes first."""
        relayed = before is not None and all(not r.static and cannot_dial(self.links, r.url) for r in (before, record))
        return RELAYED_HOP_COST if relayed else 0.0

    def hold(self, route: Route) -> Route:
        """A generation uses `route` until `route.release()`: its hops count one more in flight."""
        for url in route.urls:
            self._inflight[url] = self._inflight.get(url, 0) + 1
        route.on_done = lambda: self._release(route.urls)
        return route

    def _release(self, urls: list[str]) -> None:
        for url in urls:
            self._inflight[url] = max(0, self._inflight.get(url, 0) - 1)

    def _peer_link(self) -> Link | None:
        return self.links.get(self.static_peer) if self.static_peer else None

    def _candidates(self) -> list[NodeRecord]:
        """Nodes a route may use now: joined ones the head can reach, and the --peer chain."""
        records = [r for r in self.registry.nodes() if not r.draining and self.links.get(r.url).is_up] \
            if self.registry else []
        placement = self.placement
        if placement is not None and placement.active and placement.live is not None and placement.live.spans:
            records = [record for record in records if placement.routable(record)]  # (before: as by hand)
        link = self._peer_link()
        peer = link.peer_hello if link is not None and link.is_up else None
        if link is not None and peer is not None and peer.chain:
            span = (peer.chain[0].layers[0], peer.chain[-1].layers[1])
            if not chain_gaps([hop.layers for hop in peer.chain], self.total_layers, start=span[0]):
                records.append(NodeRecord(url=link.url, node=peer.chain[0].node, model=self.model_id, layers=span,
                                          role="peer", static=True))
        return records
