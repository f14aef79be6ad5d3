"""Joining a mesh, the head's side: `/mesh/join`, `/mesh/leave`, `/mesh/assign` and expiry.

The joining node's side (the heartbeat it sends) is `meshws.mesh.membership`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from .registry import Registry
from .routes import NodeRecord, NoRoute

log = logging.getLogger("meshws.membership")


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

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/mesh/join", self.join)
        app.router.add_post("/mesh/leave", self.leave)
        app.router.add_get("/mesh/assign", self.assign)

    async def expiry_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """Drop nodes whose heartbeats stopped, while the app runs (an aiohttp cleanup context)."""
        task = asyncio.create_task(self._expire_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

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


