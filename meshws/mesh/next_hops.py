"""Which next hop a shard forwards a session to, and the links it keeps for routes.

A session's `open` names the hops after this node; an empty route means the node's
own `--peer`. A node dials only hops a head chose: the route must carry the head's
MAC with the mesh secret (`mesh.auth.sign_route`), and the route it passes on is
signed again. Without a secret a node follows routes to loopback nodes only (unless
it runs `--insecure`). Links opened for routes are capped, and closed once no
session has used them for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any, AsyncIterator

from aiohttp import web

from .addresses import is_loopback_url
from .auth import route_is_signed, sign_route
from .link_pool import LinkPool
from .wire import Open, RouteHop

log = logging.getLogger("meshws.next_hops")

MAX_ROUTE_LINKS = 32  # next hops a middle dials and keeps links to at once
MAX_DIAL_INS = 8  # next hops that dialed in to a middle (they cannot be dialed): capped apart, so that sockets
# dialed in for invented addresses never fill the links a head's signed route needs
IDLE_LINK_SECONDS = 60.0  # a link to a next hop no session used for this long is closed


class NextHops:
    def __init__(self, backend: Any, links: LinkPool, static_peer: str | None, secret: str | None,
                 open_routes: bool) -> None:
        self.backend = backend  # its span: where the next hop must start (it moves with placement)
        self.links = links
        self.static_peer = static_peer
        self.secret = secret
        self.open_routes = open_routes  # --insecure without a secret: unsigned routes are dialed too

    @property
    def is_tail(self) -> bool:
        return bool(self.backend.is_tail)

    @property
    def end(self) -> int:
        """This node's last layer + 1: where the next hop must start."""
        return int(self.backend.end)

    def onward(self, message: Open, route: tuple[RouteHop, ...]) -> Open:
        """The `open` to send to the next hop: the rest of the route, signed again, and the next hop's own span and
        standby as the route names them (empty route: the --peer, whose span the route does not say)."""
        layers = message.route[0].layers if message.route else None
        standby = message.route[0].standby if message.route else None
        parts = signed_parts(route, standby)
        mac = sign_route(self.secret, message.sid, parts) if self.secret and parts else None
        hold = self.standby(message) is not None  # (this node has one: the next hop holds on to the session)
        return replace(message, route=route, route_mac=mac, layers=layers, standby=standby, hold=hold)

    def standby(self, message: Open) -> str | None:
        """Where to send the session's keys and values, if the head named a standby: only one it signed (without a
        secret: a loopback node, unless --insecure). None when there is none to follow."""
        url = message.standby
        if url is None or message.kept:  # (a kept prompt prefix needs none)
            return None
        if url.rstrip("/") not in self.links and self._route_links() >= MAX_ROUTE_LINKS:
            return None
        if self.secret:
            parts = signed_parts(message.route, url)
            return url if route_is_signed(self.secret, message.sid, parts, message.route_mac) else None
        return url if self.open_routes or is_loopback_url(url) else None

    def choose(self, message: Open) -> tuple[str | None, tuple[RouteHop, ...]]:
        """The URL of the next hop and the hops after it; an empty route means: use --peer."""
        route = message.route
        if self.is_tail:
            if route:
                raise ValueError("the tail is the last hop; the route must be empty here")
            return None, ()
        if route:
            self._check(message)
            layers = route[0].layers
            if layers is not None and layers[0] != self.end:
                raise ValueError(f"the next hop starts at layer {layers[0]}, this node ends at {self.end}")
            return route[0].url, route[1:]
        if self.static_peer is None:
            raise ValueError(f"no route given and this node has no --peer for layers from {self.end}")
        return self.static_peer, ()

    def _check(self, message: Open) -> None:
        """Dial only hops a head chose: a route signed with the mesh secret, within the cap of route links."""
        hops = signed_parts(message.route, message.standby)
        if self.secret:
            if not route_is_signed(self.secret, message.sid, hops, message.route_mac):
                raise ValueError("the route is not signed with the mesh secret; only a head's routes are followed")
        elif not (self.open_routes or all(is_loopback_url(hop.url) for hop in message.route)):
            raise ValueError("without a mesh secret this node follows routes to loopback nodes only")
        url = message.route[0].url.rstrip("/")
        if url not in self.links and self._route_links() >= MAX_ROUTE_LINKS:
            raise ValueError(f"this node already keeps {MAX_ROUTE_LINKS} links to next hops")

    def _route_links(self) -> int:
        return sum(not link.reversed for link in self.links.all())

    async def idle_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """Close links opened for routes once no session has used them for a while (a cleanup context)."""
        async def reap() -> None:
            while True:
                await asyncio.sleep(IDLE_LINK_SECONDS / 4)
                for url in self.links.close_idle(IDLE_LINK_SECONDS, keep={self.static_peer or ""}):
                    log.info("closed the idle link to %s", url)

        task = asyncio.create_task(reap())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def signed_parts(route: tuple[RouteHop, ...], standby: str | None) -> list[dict[str, Any]]:
    """What a route's MAC covers: the hops after the receiver (their standbys included) and the receiver's own
    standby."""
    return [hop.to_wire() for hop in route] + ([{"standby": standby}] if standby else [])
