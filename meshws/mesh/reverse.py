"""Links the other way round, for nodes nobody can dial (behind NAT, or a firewall that lets them dial out only).

A head dials each node that joins it. When those dials fail while the node keeps announcing itself (so it is
alive, only unreachable), the head's answer to its next heartbeat lists the hops that should be dialed the other
way: the head itself, and the joined middles whose layers end where the node's begin (`dial_in`). The node dials
each one's `/mesh/reverse/<its own URL, hex>` (signed with the mesh secret like any mesh request, the URL inside the
signed path, and with its node key: a head takes it only from the key the node's join bound to that URL, a middle
only from a node and key its head named) and serves that socket exactly as it serves an inbound `/ws/shard`; the dialed
side hands the socket to its link for that URL (`Link.offer`), which from then on waits for the node's dials instead of
dialing. Hellos, sessions, signed routes, losses and failover are those of a dialed link; only who opened the TCP
connection differs. Where neither side of a hop can dial the other, the head relays it (`mesh.relay`), and the two ends
seal the socket between them (`mesh.seal`).
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
from .seal import seal_answerer

log = logging.getLogger("meshws.reverse")

REVERSE_PATH = "/mesh/reverse"
RELAY_PATH = "/mesh/relay"
MAX_URL_CHARS = 512  # as a join's url
RELAYS_PER_MEMBER = 16  # relay sockets (waiting or piped) one node key may hold on a head (of relay.RELAYS in all)
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
    """The dialed side (a head, a middle): `/mesh/reverse/...` sockets handed to the links they stand for.

    With a mesh secret every dialer proves its node key (`identify`): a head takes a socket only from the key the
    node's join bound to its URL (`keys`), for that node and for relays it pipes (RELAYS_PER_MEMBER sockets per
    key); a middle only from a node its head told it to expect, with that key (`expect`)."""

    def __init__(self, links: LinkPool, authorize: Callable[[web.Request], str | None], max_frame_bytes: int,
                 joined: Callable[[], dict[str, tuple[int, int]]] | None = None,
                 relayed: Callable[[int], None] = lambda size: None,
                 identify: Callable[[web.Request], tuple[str, str | None]] = lambda request: ("", None),
                 keys: Callable[[str], str | None] = lambda url: None) -> None:
        self.links = links
        self.authorize = authorize
        self.identify = identify  # (the dialer's proven key, None) or ("", why not); ("", None) without a secret
        self.keys = keys  # a head: the key a joined node's URL is bound to
        self.expected: dict[str, str] | None = None  # a middle with a secret: URL -> key of the dial-ins it expects
        self._relaying: dict[str, int] = {}  # a head: relay sockets (waiting or piped) per member's key
        self.max_frame_bytes = max_frame_bytes
        self.joined = joined  # a head: its joined nodes' layers by URL, the only nodes it links to this way
        self.relay = Relay(self.may_relay, relayed, max_frame_bytes) if joined is not None else None

    def expect(self, dial_ins: dict[str, str]) -> None:
        """(A middle.) The nodes its heads told to dial into it, and their keys (the heartbeat's answers)."""
        self.expected = dict(dial_ins)

    def may_relay(self, tail: str, middle: str) -> bool:
        """Two distinct joined nodes, adjacent (the middle's layers end where the tail's begin: hops of one route),
        and this head could dial neither (so neither can dial the other, as far as it knows)."""
        joined = self.joined() if self.joined is not None else {}
        return tail != middle and tail in joined and middle in joined and joined[middle][1] == joined[tail][0] \
            and cannot_dial(self.links, tail) and cannot_dial(self.links, middle)

    def may_link(self, url: str, key: str = "") -> bool:
        """A head links this way only to its joined nodes, a middle to a hop its head named (with a secret; without
        one, any hop) within its cap of dialed-in links (apart from the links it dials for routes); and neither to a
        node it dials: a socket offered for a reachable node does not take its place."""
        if self.joined is not None:
            return url in set(self.joined()) and cannot_dial(self.links, url)
        if key and (self.expected or {}).get(url) != key:
            return False
        if url in self.links:
            return cannot_dial(self.links, url)
        return sum(link.reversed for link in self.links.all()) < MAX_DIAL_INS

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(REVERSE_PATH + "/{url}", self.handle)
        if self.relay is not None:
            app.router.add_get(REVERSE_PATH + "/{url}/{other}", self.handle_relay)
            app.router.add_get(RELAY_PATH + "/{url}/{other}", self.handle_relay)

    def _urls(self, request: web.Request, *names: str) -> tuple[list[str], str]:
        """The path's URLs and the dialer's key, after the request's signature and key are checked; 401 or 400 if
        either fails."""
        refusal = self.authorize(request)
        key, problem = ("", None) if refusal else self.identify(request)
        if refusal or problem:
            raise web.HTTPUnauthorized(text=refusal or problem)
        urls = [url_of(request.match_info[name]) for name in names]
        if None in urls:
            raise web.HTTPBadRequest(text="the path must name nodes' ws:// or wss:// addresses, in hex")
        return urls, key  # type: ignore[return-value]

    def _check_key(self, url: str, key: str) -> None:
        """(A head.) 403 unless `key` is the one `url`'s join bound (nothing to check without a secret)."""
        if key and self.keys(url) != key:
            raise web.HTTPForbidden(text="that address is not joined with the key this request proves")

    async def handle_relay(self, request: web.Request) -> web.StreamResponse:
        """A tail's relay-back socket (`/mesh/reverse/<tail>/<middle>`), or a middle's link to the tail
        (`/mesh/relay/<tail>/<middle>`): `mesh.relay` pairs them. Each proves the key of the node it dials for."""
        assert self.relay is not None
        (tail, middle), key = self._urls(request, "url", "other")
        back = request.path.startswith(REVERSE_PATH)
        self._check_key(tail if back else middle, key)
        if key and self._relaying.get(key, 0) >= RELAYS_PER_MEMBER:
            raise web.HTTPServiceUnavailable(text=f"this node key holds {RELAYS_PER_MEMBER} relay sockets already")
        self._relaying[key] = self._relaying.get(key, 0) + 1
        try:
            if back:
                return await self.relay.wait_back(request, tail, middle)
            return await self.relay.join(request, tail, middle)
        finally:
            self._relaying[key] -= 1
            if not self._relaying[key]:
                del self._relaying[key]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        [url], key = self._urls(request, "url")
        if self.joined is not None:
            self._check_key(url, key)
        if not self.may_link(url, key):
            raise web.HTTPForbidden(text="this node keeps no link to that address (not a joined node, not one its "
                                         "head named with that key, or too many)")
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
                 secret: str | None, ssl: Any, max_frame_bytes: int, links: LinkPool | None = None,
                 identity: Any = None) -> None:
        self.own_url = own_url
        self.identity = identity  # this node's key: the dialed side checks it is the one bound to own_url
        self.links = links  # this node's links to next hops (a middle's: some may go through a head's relay)
        self.serve = serve  # runs one socket as an inbound link until it closes
        self.secret = secret
        self.ssl = ssl
        self.max_frame_bytes = max_frame_bytes
        self._tasks: dict[tuple[str, str | None], asyncio.Task] = {}
        self._state: dict[tuple[str, str | None], dict[str, Any]] = {}
        self.peer_keys: dict[str, str] = {}  # middles this node dials in to, relayed hops: keys, as heads name them
        self.heads: set[str] = set()  # the heads this node joins (they name their own keys)

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
                link.relay_seal = (self.own_url(), self.peer_keys.get(url))  # (`mesh.seal`, with a secret)

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
                try:  # (a middle must hold the key the heads named for it; a head names its own)
                    peer_key = None if self.identity is None or hop in {http_base(h) for h in self.heads} else \
                        next((key for url, key in self.peer_keys.items() if http_base(url) == hop), "")
                    headers = await signed_headers(client, hop, self.secret, "GET", path, ssl=self.ssl,
                                                   identity=self.identity, peer_key=peer_key)
                    async with client.ws_connect(hop + path, heartbeat=5.0, headers=headers, ssl=self.ssl,
                                                 max_msg_size=2 * self.max_frame_bytes + 65536) as ws:
                        sealed = ws
                        if relay_for and self.identity is not None:  # (the middle seals first, through the relay)
                            sealed = await seal_answerer(ws, self.identity, self.own_url(), relay_for,
                                                         self.peer_keys.get(relay_for))
                        state.update(state="up", error=None, since=time.time(), connects=state["connects"] + 1)
                        wait = REDIAL_SECONDS[0]
                        await self.serve(sealed, f"{hop} (dialed from here)")
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
