"""Joining a mesh, the node's side: the heartbeat a joined node sends.

A middle or tail started with `--join http://HEAD:PORT` POSTs its record to
`/mesh/join` every `HEARTBEAT` seconds (the first POST joins, later ones are the
heartbeat) and `/mesh/leave` when it stops. `--join` may name several heads,
comma-separated: the node announces itself to each (so heads behind one load balancer
share a pool of shards), and one head that is down does not hold up the others.
A record carries the node's measured capacity; each heartbeat's round trip is timed
(`on_round_trip`). An automatic node (`--layers auto`) follows the plan of the first
head only: that head's answers go to `on_answer`, and the others hear the node as
placed where it is. While it moves (`hurry`), it beats every `HURRIED` seconds. A head
that cannot dial the node says so in its answer, with the hops to dial instead
(`mesh.reverse`); a middle's answer names the nodes told to dial into it, with their keys
(`expect`). Every request carries the node's key (`mesh.identity`) when it has one.
The head's side is `meshws.head.membership`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import aiohttp
import orjson

from .auth import signed_headers
from .identity import is_key
from .reverse import ReverseDialer

log = logging.getLogger("meshws.membership")

HEARTBEAT = 2.0  # seconds between a joined node's announcements
HURRIED = 0.25  # ... while it moves its layers
MAX_DIAL_IN = 16  # hops one head may ask this node to dial


async def post_signed(client: aiohttp.ClientSession, head: str, path: str, data: dict[str, Any],
                      secret: str | None, ssl: Any, identity: Any = None) -> Any:
    """POST JSON to a head's /mesh endpoint, signed for that head, that body and that path (with the secret, and
    with this node's key if it has one); the answer."""
    body = orjson.dumps(data)
    headers = await signed_headers(client, head, secret, "POST", path, body, ssl=ssl, identity=identity)
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
                 ssl: Any = True, reverse: ReverseDialer | None = None,
                 on_answer: Callable[[Any], None] = lambda answer: None,
                 on_round_trip: Callable[[float], None] = lambda seconds: None,
                 hurry: Callable[[], bool] = lambda: False, identity: Any = None,
                 expect: Callable[[dict[str, str]], None] = lambda dial_ins: None) -> None:
        self.heads = head_urls(heads)
        self.identity = identity  # this node's key: each head binds the node's URL to it
        self.expect = expect  # the dial-ins this node's heads announce (URL -> key), for a middle's endpoint
        self._expected: dict[str, dict[str, str]] = {}  # per head
        self._keys: dict[str, dict[str, str]] = {}  # per head: the keys of the other ends of relayed hops
        self.on_answer = on_answer  # the first head's answers (an automatic node's plan)
        self.on_round_trip = on_round_trip  # each heartbeat's seconds there and back
        self.hurry = hurry  # beat every HURRIED seconds while this is true
        self.reverse = reverse  # dials the hops a head says cannot dial this node
        if reverse is not None:
            reverse.heads = set(self.heads)
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
            self._answered(head, await post_signed(client, head, "/mesh/join", self._record(head), self.secret,
                                                   self.ssl, self.identity))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError):
            pass  # the heartbeat tries again

    async def _leave(self, client: aiohttp.ClientSession, head: str) -> None:
        try:
            await post_signed(client, head, "/mesh/leave", {"url": self.record()["url"]}, self.secret, self.ssl,
                              self.identity)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError):
            pass  # the head drops us when the heartbeats stop

    async def _announce_forever(self, head: str) -> None:
        failures = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
            while True:
                try:
                    began = time.monotonic()
                    answer = await post_signed(client, head, "/mesh/join", self._record(head), self.secret, self.ssl,
                                               self.identity)
                    self.on_round_trip(time.monotonic() - began)
                    self._heard(head, answer)
                    self._answered(head, answer)
                    if head not in self.joined_heads:
                        log.info("joined the mesh at %s", head)
                    self.joined_heads.add(head)
                    failures = 0
                except Exception as exc:  # (whatever answered at the head's address: the heartbeat goes on)
                    failures += 1
                    if failures == 1 or failures % 15 == 0:
                        log.warning("cannot announce to %s (%s); retrying", head, exc)
                    self.joined_heads.discard(head)
                    self._forget(head)
                await asyncio.sleep(HURRIED if self.hurry() else HEARTBEAT)

    def _record(self, head: str) -> dict[str, Any]:
        """The record for `head`: an automatic node is placed by its first head; to the others, where it is."""
        record = self.record()
        return record if head == self.heads[0] else {**record, "auto": False}

    def _answered(self, head: str, answer: Any) -> None:
        if head == self.heads[0]:
            self.on_answer(answer)

    def _heard(self, head: str, answer: Any) -> None:
        """A head's answer to a heartbeat: if it cannot dial this node, the sockets to dial instead (to it, to
        the middles before this node, and relay-back ones for middles nobody can dial) and the next hops to reach
        through its relay; checked as any input from the network."""
        if not isinstance(answer, dict):
            return
        expected = _dial_ins(answer.get("dial_ins"))
        if expected != self._expected.get(head, {}):
            self._expected[head] = expected
            self.expect(_agreed(self._expected))
        if self.reverse is None:
            return
        wanted: list[tuple[str, str | None]] = []
        relay: list[str] = []
        if answer.get("unreachable") is True:
            dial_in, relay_for = _urls(answer.get("dial_in")), _urls(answer.get("relay_for"))
            wanted = [(head, None)] + [(url, None) for url in dial_in] + [(head, url) for url in relay_for]
            relay = _urls(answer.get("relay"))
        keys = answer.get("keys") if isinstance(answer.get("keys"), dict) else {}
        ends = set(relay) | {url for _, url in wanted if url} | {hop for hop, _ in wanted if hop != head}
        named = {url.rstrip("/"): key for url, key in keys.items() if url in ends and is_key(key)}
        if named != self._keys.get(head, {}):  # (the nodes this one dials in to or is relayed with, by key)
            self._keys[head] = named
            self.reverse.peer_keys = _agreed(self._keys)
        if relay:
            self.reverse.relay_through(head, relay)
        if wanted != self._dial_in.get(head, []):
            self._dial_in[head] = wanted
            self.reverse.want(target for targets in self._dial_in.values() for target in targets)

    def _forget(self, head: str) -> None:
        """A head that did not answer names no keys any more (until it answers again)."""
        if self._expected.pop(head, None):
            self.expect(_agreed(self._expected))
        if self._keys.pop(head, None) and self.reverse is not None:
            self.reverse.peer_keys = _agreed(self._keys)


def _agreed(per_head: dict[str, dict[str, str]]) -> dict[str, str]:
    """URL -> key as the heads name them; a URL two heads name different keys for is named by none (refused)."""
    merged: dict[str, str] = {}
    disputed = set()
    for named in per_head.values():
        for url, key in named.items():
            if merged.setdefault(url, key) != key:
                disputed.add(url)
    if disputed:
        log.warning("the heads name different keys for %s: refusing those nodes", ", ".join(sorted(disputed)))
    return {url: key for url, key in merged.items() if url not in disputed}


def _dial_ins(listed: Any) -> dict[str, str]:
    """The nodes a head told to dial into this one (a middle), each with the key its join proved: URL -> key."""
    listed = listed if isinstance(listed, list) else []
    found = {}
    for item in listed[:MAX_DIAL_IN]:
        if isinstance(item, dict) and _urls([item.get("url")]) and is_key(item.get("key")):
            found[item["url"].rstrip("/")] = item["key"]
    return found


def _urls(listed: Any) -> list[str]:
    """Node addresses a head listed: ws:// or wss:// strings, a few."""
    listed = listed if isinstance(listed, list) else []
    return [url for url in listed[:MAX_DIAL_IN]
            if isinstance(url, str) and len(url) <= 512 and url.startswith(("ws://", "wss://"))]
