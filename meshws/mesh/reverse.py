"""Links the other way round, for nodes nobody can dial (behind NAT, or a firewall that lets them dial out only).

A head dials each node that joins it. When those dials fail while the node keeps announcing itself (so it is
alive, only unreachable), the head's answer to its next heartbeat lists the hops that should be dialed the other
way: the head itself, and the joined middles whose layers end where the node's begin (`dial_in`). The node dials
each one's `/mesh/reverse/<its own URL, hex>` (signed with the mesh secret like any mesh request, the URL inside the
signed path) and serves that socket exactly as it serves an inbound `/ws/shard`; the dialed side hands the socket
to its link for that URL (`Link.offer`), which from then on waits for the node's dials instead of dialing. Hellos,
sessions, signed routes, losses and failover are those of a dialed link; only who opened the TCP connection differs.
Where neither side of a hop can dial the other, the head relays it (`mesh.relay`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from .auth import http_base, signed_headers
from .link import DIAL_TIMEOUT
from .link_pool import LinkPool
from .next_hops import MAX_DIAL_INS
from .relay import Relay

log = logging.getLogger("meshws.reverse")

REVERSE_PATH = "/mesh/reverse"
RELAY_PATH = "/mesh/relay"
MAX_URL_CHARS = 512  # as a join's url
REDIAL_SECONDS = (0.2, 3.0)  # first and longest wait before dialing a hop again


def reverse_path(own_url: str, relay_for: str | None = None) -> str:
    """The path a node dials back on: its advertised URL in hex (no escaping for proxies or yarl to redo); and
    for a relay-back socket, the middle's it is for."""
    return f"{REVERSE_PATH}/{hexed(own_url)}" + (f"/{hexed(relay_for)}" if relay_for else "")


def relay_path(tail: str, middle: str) -> str:
    """The path a middle's link to `tail` dials on the head that relays it."""
    return f"{RELAY_PATH}/{hexed(tail)}/{hexed(middle)}"


def hexed(url: str) -> str:
    return url.rstrip("/").encode().hex()


def url_of(hexed: str) -> str | None:
    """The URL a reverse path names, or None if it names none a node could have."""
    if len(hexed) > 2 * MAX_URL_CHARS:
        return None
    try:
        url = bytes.fromhex(hexed).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return url if url.startswith(("ws://", "wss://")) and url.isprintable() and " " not in url else None


class ReverseEndpoint:
    """The dialed side (a head, a middle): `/mesh/reverse/...` sockets handed to the links they stand for."""

    def __init__(self, links: LinkPool, authorize: Callable[[web.Request], str | None], max_frame_bytes: int,
                 joined: Callable[[], dict[str, tuple[int, int]]] | None = None,
                 relayed: Callable[[int], None] = lambda size: None) -> None:
        self.links = links
        self.authorize = authorize
        self.max_frame_bytes = max_frame_bytes
        self.joined = joined  # a head: its joined nodes' layers by URL, the only nodes it links to this way
        self.relay = Relay(self.may_relay, relayed, max_frame_bytes) if joined is not None else None

    def may_relay(self, tail: str, middle: str) -> bool:
        """Two distinct joined nodes, adjacent (the middle's layers end where the tail's begin: hops of one route),
        and this head could dial neither (so neither can dial the other, as far as it knows)."""
        joined = self.joined() if self.joined is not None else {}
        return tail != middle and tail in joined and middle in joined and joined[middle][1] == joined[tail][0] \
            and cannot_dial(self.links, tail) and cannot_dial(self.links, middle)

    def may_link(self, url: str) -> bool:
        """A head links this way only to its joined nodes, a middle to any hop (the secret says it is one of the
        mesh's) within its cap of dialed-in links (apart from the links it dials for routes); and neither to a node
        it dials: a socket offered for a reachable node does not take its place."""
        if self.joined is not None:
            return url in set(self.joined()) and cannot_dial(self.links, url)
        if url in self.links:
            return cannot_dial(self.links, url)
        return sum(link.reversed for link in self.links.all()) < MAX_DIAL_INS

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(REVERSE_PATH + "/{url}", self.handle)
        if self.relay is not None:
            app.router.add_get(REVERSE_PATH + "/{url}/{other}", self.handle_relay)
            app.router.add_get(RELAY_PATH + "/{url}/{other}", self.handle_relay)

    def _urls(self, request: web.Request, *names: str) -> list[str]:
        """The path's URLs, after the request's signature is checked; 401 or 400 if either fails."""
        refusal = self.authorize(request)
        if refusal:
            raise web.HTTPUnauthorized(text=refusal)
        urls = [url_of(request.match_info[name]) for name in names]
        if None in urls:
            raise web.HTTPBadRequest(text="the path must name nodes' ws:// or wss:// addresses, in hex")
        return urls  # type: ignore[return-value]

    async def handle_relay(self, request: web.Request) -> web.StreamResponse:
        """A tail's relay-back socket (`/mesh/reverse/<tail>/<middle>`), or a middle's link to the tail
        (`/mesh/relay/<tail>/<middle>`): `mesh.relay` pairs them."""
        assert self.relay is not None
        tail, middle = self._urls(request, "url", "other")
        if request.path.startswith(REVERSE_PATH):
            return await self.relay.wait_back(request, tail, middle)
        return await self.relay.join(request, tail, middle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        [url] = self._urls(request, "url")
        if not self.may_link(url):
            raise web.HTTPForbidden(text="this node keeps no link to that address (not a joined node, or too many)")
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=self.max_frame_bytes + 65536)
        await ws.prepare(request)
        log.info("%s dialed in: its link runs over that socket (it cannot be dialed)", url)
        try:
            await self.links.get(url).offer(ws)  # done when the link has finished with the socket
        finally:
            if not ws.closed:
                await ws.close()
        return ws


class ReverseDialer:
    """The node nobody can dial: one socket to each hop that should have dialed it, re-dialed while asked for."""

    def __init__(self, own_url: Callable[[], str], serve: Callable[[Any, str], Awaitable[None]],
                 secret: str | None, ssl: Any, max_frame_bytes: int, links: LinkPool | None = None) -> None:
        self.own_url = own_url
        self.links = links  # this node's links to next hops (a middle's: some may go through a head's relay)
        self.serve = serve  # runs one socket as an inbound link until it closes
        self.secret = secret
        self.ssl = ssl
        self.max_frame_bytes = max_frame_bytes
        self._tasks: dict[tuple[str, str | None], asyncio.Task] = {}
        self._state: dict[tuple[str, str | None], dict[str, Any]] = {}

    def want(self, targets: Iterable[tuple[str, str | None]]) -> None:
        """The sockets to keep (a head's latest answers): (hop, None) for a hop that cannot dial this node, and
        (head, middle) for a relay-back socket to a head that relays a middle's link here. New ones start, others
        stop."""
        wanted = {(http_base(hop.rstrip("/")), relay_for) for hop, relay_for in targets}
        for key in set(self._tasks) - wanted:
            self._tasks.pop(key).cancel()
            self._state.pop(key, None)
        for key in wanted - set(self._tasks):
            hop, relay_for = key
            log.info("%s", f"{hop} relays {relay_for}'s link to this node" if relay_for else
                     f"{hop} cannot dial this node: dialing it instead")
            self._state[key] = {"to": hop, "relay_for": relay_for, "state": "dialing", "connects": 0, "error": None,
                                "since": time.time()}
            self._tasks[key] = asyncio.create_task(self._keep(hop, relay_for), name=f"reverse {hop}")

    def relay_through(self, head: str, next_hops: Iterable[str]) -> None:
        """Links to these next hops (which cannot be dialed, nor dial this node) go through `head`'s relay."""
        for url in next_hops:
            if self.links is not None:
                link = self.links.get(url)
                if link.relay_via is None:
                    log.info("the link to %s goes through %s's relay (neither side can dial the other)", url, head)
                link.relay_via = (http_base(head.rstrip("/")), relay_path(url, self.own_url()))

    def describe(self) -> list[dict[str, Any]]:
        return [dict(state) for state in self._state.values()]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, hop: str, relay_for: str | None) -> None:
        wait = REDIAL_SECONDS[0]
        state = self._state[(hop, relay_for)]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=DIAL_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as client:
            while True:
                path = reverse_path(self.own_url(), relay_for)
                try:
                    headers = await signed_headers(client, hop, self.secret, "GET", path, ssl=self.ssl)
                    async with client.ws_connect(hop + path, heartbeat=5.0, headers=headers, ssl=self.ssl,
                                                 max_msg_size=2 * self.max_frame_bytes + 65536) as ws:
                        state.update(state="up", error=None, since=time.time(), connects=state["connects"] + 1)
                        wait = REDIAL_SECONDS[0]
                        await self.serve(ws, f"{hop} (dialed from here)")
                        state.update(state="dialing", error=f"closed (code {ws.close_code})", since=time.time())
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # every way a dial can fail ends in a retry
                    state.update(state="dialing", error=f"{type(exc).__name__}: {exc}"[:300], since=time.time())
                await asyncio.sleep(wait)
                wait = min(2 * wait, REDIAL_SECONDS[1])


def cannot_dial(links: LinkPool, url: str) -> bool:
    """Has this node failed to dial the node at `url` (which just announced itself, so it is alive)? (No link to
    it: not that anyone knows.)"""
    if url not in links:
        return False
    link = links.get(url)
    return link.reversed or (not link.is_up and link.dial_failures > 0)
