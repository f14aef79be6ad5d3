"""Joining a mesh: the head's /mesh endpoints, and the heartbeat a joined node sends.

A middle or tail started with `--join http://HEAD:PORT` POSTs its record to
`/mesh/join` every `HEARTBEAT` seconds (the first POST joins, later ones are the
heartbeat) and `/mesh/leave` when it stops. `--layers auto` asks
`GET /mesh/assign` which span to load before loading anything.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp
from aiohttp import web

from .routing import NodeRecord, NoRoute, Registry

log = logging.getLogger("meshws.membership")

HEARTBEAT = 2.0  # seconds between a joined node's announcements


class RegistryEndpoints:
    """The head's side: keeps `Registry` current from announcements and expiry."""

    def __init__(self, registry: Registry, head_span: tuple[int, int],
                 on_join: Callable[[NodeRecord], None], on_leave: Callable[[str], None],
                 authorize: Callable[[web.Request], str | None] = lambda request: None) -> None:
        self.registry = registry
        self.head_span = head_span
        self.on_join = on_join
        self.on_leave = on_leave
        self.authorize = authorize
        self._task: asyncio.Task | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/mesh/join", self.join)
        app.router.add_post("/mesh/leave", self.leave)
        app.router.add_get("/mesh/assign", self.assign)

    def start(self) -> None:
        self._task = asyncio.create_task(self._expire_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def join(self, request: web.Request) -> web.Response:
        refusal = self.authorize(request)
        if refusal:
            log.warning("refused a join from %s: %s", request.remote, refusal)
            return web.json_response({"error": refusal}, status=401)
        try:
            data = await request.json()
            record = _record(data)
            known = record.url in {r.url for r in self.registry.nodes()}
            self.registry.announce(record)
        except (ValueError, TypeError, KeyError) as exc:
            return web.json_response({"error": f"bad join: {exc}"}, status=400)
        if not known:
            log.info("node %s joined: %s layers %d-%d", record.node, record.url, record.layers[0], record.layers[1] - 1)
            self.on_join(record)
        return web.json_response({"ok": True, "ttl": self.registry.ttl})

    async def leave(self, request: web.Request) -> web.Response:
        refusal = self.authorize(request)
        if refusal:
            return web.json_response({"error": refusal}, status=401)
        try:
            url = str((await request.json())["url"])
        except (ValueError, TypeError, KeyError):
            return web.json_response({"error": "bad leave: send {\"url\": ...}"}, status=400)
        if self.registry.leave(url):
            log.info("node at %s left", url)
            self.on_leave(url)
        return web.json_response({"ok": True})

    async def assign(self, request: web.Request) -> web.Response:
        refusal = self.authorize(request)
        if refusal:
            return web.json_response({"error": refusal}, status=401)
        try:
            start, end = self.registry.assign(self.head_span)
        except NoRoute as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"layers": [start, end], "model": self.registry.model,
                                  "total_layers": self.registry.total_layers})

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for record in self.registry.expire():
                log.warning("node %s (%s) stopped answering; removed from the registry", record.node, record.url)
                self.on_leave(record.url)


def _record(data: Any) -> NodeRecord:
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    url, node, model, layers = data["url"], data.get("node") or data["url"], data["model"], data["layers"]
    if not isinstance(url, str) or not url.startswith(("ws://", "wss://")):
        raise ValueError("url must be a ws:// address")
    if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(n, int) for n in layers)):
        raise ValueError("layers must be [start, end]")
    capacity, load = int(data.get("capacity", 0)), int(data.get("load", 0))
    return NodeRecord(url=url.rstrip("/"), node=str(node), model=str(model), layers=(layers[0], layers[1]),
                      role=str(data.get("role", "tail")), capacity=capacity, load=load)


class Announcer:
    """A joined node's side: announce, repeat as a heartbeat, leave on stop."""

    def __init__(self, head: str, record: Callable[[], dict[str, Any]],
                 headers: Callable[[str], dict[str, str]] = lambda path: {}) -> None:
        self.head = head.rstrip("/")
        self.record = record
        self.headers = headers
        self.joined = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._announce_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as client:
                await client.post(f"{self.head}/mesh/leave", json={"url": self.record()["url"]},
                                  headers=self.headers("/mesh/leave"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass  # the head drops us when the heartbeats stop

    async def _announce_forever(self) -> None:
        failures = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
            while True:
                try:
                    async with client.post(f"{self.head}/mesh/join", json=self.record(),
                                           headers=self.headers("/mesh/join")) as response:
                        body = await response.json(content_type=None)
                        if response.status != 200:
                            raise RuntimeError(body.get("error") if isinstance(body, dict) else response.status)
                    if not self.joined:
                        log.info("joined the mesh at %s", self.head)
                    self.joined, failures = True, 0
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError) as exc:
                    failures += 1
                    if failures == 1 or failures % 15 == 0:
                        log.warning("cannot announce to %s (%s); retrying", self.head, exc)
                    self.joined = False
                await asyncio.sleep(HEARTBEAT)


async def ask_assignment(head: str, headers: Callable[[str], dict[str, str]]) -> tuple[int, int, int]:
    """`--layers auto`: the span the head wants this node to serve (retries until the head answers)."""
    delay = 0.5
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        while True:
            try:
                async with client.get(f"{head.rstrip('/')}/mesh/assign", headers=headers("/mesh/assign")) as response:
                    body = await response.json(content_type=None)
                    if response.status == 200:
                        return body["layers"][0], body["layers"][1], body["total_layers"]
                    raise RuntimeError(body.get("error"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, KeyError, ValueError) as exc:
                log.warning("asking %s for layers failed (%s); retrying", head, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
