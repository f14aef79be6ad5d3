"""Joining a mesh, the node's side: the heartbeat a joined node sends, and `--layers auto`.

A middle or tail started with `--join http://HEAD:PORT` POSTs its record to
`/mesh/join` every `HEARTBEAT` seconds (the first POST joins, later ones are the
heartbeat) and `/mesh/leave` when it stops. `--join` may name several heads,
comma-separated: the node announces itself to each (so heads behind one load balancer
share a pool of shards), and one head that is down does not hold up the others.
`--layers auto` asks the first head, `GET /mesh/assign`, which span to load before
loading anything. A head that cannot dial the node says so in its answer, with the
hops to dial instead (`mesh.reverse`). The head's side is `meshws.head.membership`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp
import orjson

from .auth import signed_headers
from .reverse import ReverseDialer

log = logging.getLogger("meshws.membership")

HEARTBEAT = 2.0  # seconds between a joined node's announcements
MAX_DIAL_IN = 16  # hops one head may ask this node to dial


async def post_signed(client: aiohttp.ClientSession, head: str, path: str, data: dict[str, Any],
                      secret: str | None, ssl: Any) -> Any:
    """POST JSON to a head's /mesh endpoint, signed for that head, that body and that path; the answer."""
    body = orjson.dumps(data)
    headers = await signed_headers(client, head, secret, "POST", path, body, ssl=ssl)
    headers["Content-Type"] = "application/json"
    async with client.post(f"{head}{path}", data=body, headers=headers, ssl=ssl) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(answer.get("error") if isinstance(answer, dict) else f"HTTP {response.status}")
        return answer


def head_urls(join: str) -> list[str]:
    """The heads named by --join (comma-separated)."""
    return [part.strip().rstrip("/") for part in join.split(",") if part.strip()]


class Announcer:
    """A joined node's side: announce to every head, repeat as a heartbeat, leave them all on stop."""

    def __init__(self, heads: str, record: Callable[[], dict[str, Any]], secret: str | None = None,
                 ssl: Any = True, reverse: ReverseDialer | None = None) -> None:
        self.heads = head_urls(heads)
        self.reverse = reverse  # dials the hops a head says cannot dial this node
        self._dial_in: dict[str, list[tuple[str, str | None]]] = {}  # per head: the sockets it asked for
        self.record = record
        self.secret = secret
        self.ssl = ssl  # verifies an https:// head (the system's CAs, or --tls-ca)
        self.joined_heads: set[str] = set()
        self._tasks: list[asyncio.Task] = []

    @property
    def joined(self) -> bool:
        """Whether every head has taken this node's latest heartbeat."""
        return bool(self.heads) and self.joined_heads == set(self.heads)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._announce_forever(head)) for head in self.heads]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return  # never started, or stopped already
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as client:
            await asyncio.gather(*(self._leave(client, head) for head in self.heads))
        self.joined_heads.clear()
        if self.reverse is not None:
            await self.reverse.stop()

    async def announce_now(self) -> None:
        """Announce to every head at once, between heartbeats (a change heads should hear of now)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as client:
            await asyncio.gather(*(self._announce(client, head) for head in self.heads))

    async def _announce(self, client: aiohttp.ClientSession, head: str) -> None:
        try:
            await post_signed(client, head, "/mesh/join", self.record(), self.secret, self.ssl)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError):
            pass  # the heartbeat tries again

    async def _leave(self, client: aiohttp.ClientSession, head: str) -> None:
        try:
            await post_signed(client, head, "/mesh/leave", {"url": self.record()["url"]}, self.secret, self.ssl)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError):
            pass  # the head drops us when the heartbeats stop

    async def _announce_forever(self, head: str) -> None:
        failures = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
            while True:
                try:
                    self._heard(head, await post_signed(client, head, "/mesh/join", self.record(), self.secret,
                                                        self.ssl))
                    if head not in self.joined_heads:
                        log.info("joined the mesh at %s", head)
                    self.joined_heads.add(head)
                    failures = 0
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError) as exc:
                    failures += 1
                    if failures == 1 or failures % 15 == 0:
                        log.warning("cannot announce to %s (%s); retrying", head, exc)
                    self.joined_heads.discard(head)
                await asyncio.sleep(HEARTBEAT)


    def _heard(self, head: str, answer: Any) -> None:
        """A head's answer to a heartbeat: if it cannot dial this node, the sockets to dial instead (to it, to
        the middles before this node, and relay-back ones for middles nobody can dial) and the next hops to reach
        through its relay; checked as any input from the network."""
        if self.reverse is None or not isinstance(answer, dict):
            return
        wanted: list[tuple[str, str | None]] = []
        relay: list[str] = []
        if answer.get("unreachable") is True:
            wanted = [(head, None)] + [(url, None) for url in _urls(answer.get("dial_in"))] + \
                [(head, url) for url in _urls(answer.get("relay_for"))]
            relay = _urls(answer.get("relay"))
        if relay:
            self.reverse.relay_through(head, relay)
        if wanted != self._dial_in.get(head, []):
            self._dial_in[head] = wanted
            self.reverse.want(target for targets in self._dial_in.values() for target in targets)


def _urls(listed: Any) -> list[str]:
    """Node addresses a head listed: ws:// or wss:// strings, a few."""
    listed = listed if isinstance(listed, list) else []
    return [url for url in listed[:MAX_DIAL_IN]
            if isinstance(url, str) and len(url) <= 512 and url.startswith(("ws://", "wss://"))]


async def ask_assignment(head: str, secret: str | None, ssl: Any = True) -> tuple[int, int, int]:
    """`--layers auto`: the span the (first) head wants this node to serve (retries until it answers)."""
    delay = 0.5
    head = head_urls(head)[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        while True:
            try:
                headers = await signed_headers(client, head, secret, "GET", "/mesh/assign", ssl=ssl)
                async with client.get(f"{head}/mesh/assign", headers=headers, ssl=ssl) as response:
                    body = await response.json(content_type=None)
                    if response.status == 200:
                        return body["layers"][0], body["layers"][1], body["total_layers"]
                    raise RuntimeError(body.get("error"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, KeyError, ValueError) as exc:
                log.warning("asking %s for layers failed (%s); retrying", head, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
