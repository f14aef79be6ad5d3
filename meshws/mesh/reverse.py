"""Links the other way round, for nodes nobody can dial (behind NAT, or a firewall that lets them dial out only).

A head dials each node that joins it. When those dials fail while the node keeps announcing itself (so it is
alive, only unreachable), the head's answer to its next heartbeat lists the hops that should be dialed the other
way: the head itself, and the joined middles whose layers end where the node's begin (`dial_in`). The node dials
each one's `/mesh/reverse/<its own URL, hex>` (signed with the mesh secret like any mesh request, the URL inside the
signed path) and serves that socket exactly as it serves an inbound `/ws/shard`; the dialed side hands the socket
to its link for that URL (`Link.offer`), which from then on waits for the node's dials instead of dialing. Hellos,
sessions, MACs, losses and failover are those of a dialed link; only who opened the TCP connection differs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from .auth import signed_headers
from .link import DIAL_TIMEOUT
from .link_pool import LinkPool
from .next_hops import MAX_ROUTE_LINKS

log = logging.getLogger("meshws.reverse")

REVERSE_PATH = "/mesh/reverse"
MAX_URL_CHARS = 512  # as a join's url
REDIAL_SECONDS = (0.2, 3.0)  # first and longest wait before dialing a hop again


def reverse_path(own_url: str) -> str:
    """The path a node dials back on: its advertised URL in hex (no escaping for proxies or yarl to redo)."""
    return f"{REVERSE_PATH}/{own_url.rstrip('/').encode().hex()}"


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
                 joined: Callable[[], Iterable[str]] | None = None) -> None:
        self.links = links
        self.authorize = authorize
        self.max_frame_bytes = max_frame_bytes
        self.joined = joined  # a head: the URLs of its joined nodes, the only ones it links to this way
        self.accepted = 0

    def may_link(self, url: str) -> bool:
        """A head links this way only to its joined nodes, a middle to any hop (the secret says it is one of the
        mesh's) within its cap of links; and neither to a node it dials: a socket offered for a reachable node
        does not take its place."""
        if url in self.links:
            return cannot_dial(self.links, url)
        return self.joined is None and len(self.links.all()) < MAX_ROUTE_LINKS

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(REVERSE_PATH + "/{url}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        refusal = self.authorize(request)
        if refusal:
            raise web.HTTPUnauthorized(text=refusal)
        url = url_of(request.match_info["url"])
        if url is None:
            raise web.HTTPBadRequest(text="the path must name the dialing node's ws:// or wss:// address, in hex")
        if not self.may_link(url):
            raise web.HTTPForbidden(text="this node keeps no link to that address (not a joined node, or too many)")
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=self.max_frame_bytes + 65536)
        await ws.prepare(request)
        self.accepted += 1
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
                 secret: str | None, ssl: Any, max_frame_bytes: int) -> None:
        self.own_url = own_url
        self.serve = serve  # runs one socket as an inbound link until it closes
        self.secret = secret
        self.ssl = ssl
        self.max_frame_bytes = max_frame_bytes
        self._tasks: dict[str, asyncio.Task] = {}
        self._state: dict[str, dict[str, Any]] = {}

    def want(self, hops: Iterable[str]) -> None:
        """The hops to dial (a head's latest answer, http(s) or ws(s) addresses): new ones start, others stop."""
        wanted = {http_url(hop) for hop in hops}
        for hop in set(self._tasks) - wanted:
            self._tasks.pop(hop).cancel()
            self._state.pop(hop, None)
        for hop in wanted - set(self._tasks):
            log.info("%s cannot dial this node: dialing it instead", hop)
            self._state[hop] = {"to": hop, "state": "dialing", "connects": 0, "error": None, "since": time.time()}
            self._tasks[hop] = asyncio.create_task(self._keep(hop), name=f"reverse {hop}")

    def describe(self) -> list[dict[str, Any]]:
        return [dict(state) for state in self._state.values()]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, hop: str) -> None:
        wait = REDIAL_SECONDS[0]
        state = self._state[hop]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=DIAL_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as client:
            while True:
                path = reverse_path(self.own_url())
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
    """Has this node failed to dial the node at `url` (which just announced itself, so it is alive)?"""
    link = links.get(url)
    return link.reversed or (not link.is_up and link.dial_failures > 0)


def http_url(address: str) -> str:
    """ws://host:port -> http://host:port (wss -> https); http(s) as given; no trailing slash."""
    address = address.rstrip("/")
    for scheme, http in (("ws://", "http://"), ("wss://", "https://")):
        if address.startswith(scheme):
            return http + address[len(scheme):]
    return address
