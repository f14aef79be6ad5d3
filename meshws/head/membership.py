"""Joining a mesh, the head's side: `/mesh/join`, `/mesh/leave` and expiry.

A join carries the node's measured capacity (`measured`: seconds per mean layer, memory budget, the heartbeat's
round trip), checked here: a value that is negative, not finite or absurd refuses the join. The answer to an
automatic node's heartbeat carries the span its head's plan gives it (`rebalance.Placement.instruction`).
The joining node's side (the heartbeat it sends) is `meshws.mesh.membership`.

With a mesh secret, each join, heartbeat and leave also proves the node's own key (`mesh.identity`, checked by
`identify`): the first join binds the URL to that key, and while the registration lives (until the node leaves
or stops answering) a join or leave for that URL with another key is refused (409, 403). A middle's answer names
the nodes told to dial into it, with their keys, so that it takes sockets from those only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any, AsyncIterator, Callable

import orjson
from aiohttp import web

from ..mesh.log_limit import LogLimiter
from .registry import BIND_GRACE, Registry
from .routes import NodeRecord

log = logging.getLogger("meshws.membership")


MAX_NODES = 256  # joined nodes a head keeps at once
URLS_PER_KEY = 16  # of them, joined with one node key (nodes started from one cache folder share their key)
MAX_BODY_BYTES = 64 * 1024  # a join is a few hundred bytes
BODY_SECONDS = 10.0  # for a /mesh body to arrive whole
MAX_LOAD = 1_000_000  # load and capacity above this are clamped
MAX_LAYER_MS = 60_000.0  # a measured speed slower than a minute per layer per token is not believed
MAX_LINK_MS = 60_000.0
MAX_MEMORY = 2**50  # a memory budget above a pebibyte is not believed
MAX_VERSION = 2**53
Authorize = Callable[[web.Request, bytes], "str | None"]  # None, or why the request may not do this
Identify = Callable[[web.Request, bytes], "tuple[str, str | None]"]  # (the key it proves, None), or ("", why not)


class RegistryEndpoints:
    """The head's side: keeps `Registry` current from announcements and expiry."""

    def __init__(self, registry: Registry,
                 on_join: Callable[[NodeRecord], None], on_leave: Callable[[str], None],
                 authorize: Authorize, insecure: bool = False,
                 precheck: Callable[[web.Request], "str | None"] = lambda request: None,
                 unreachable: Callable[[str], bool] = lambda url: False,
                 instruction: Callable[[str], "dict[str, Any] | None"] = lambda url: None,
                 expected: Callable[[str], "tuple[int, int] | None"] = lambda url: None,
                 identify: Identify = lambda request, body: ("", None), reserved: str = "") -> None:
        self.registry = registry
        self.reserved = reserved  # this head's --peer: not a URL to join with
        self.identify = identify
        self.instruction = instruction  # the span the plan gives an automatic node (`rebalance`)
        self.expected = expected  # the span an automatic node is moving to (its link may say it first)
        self.on_join = on_join
        self.on_leave = on_leave
        self.authorize = authorize
        self.precheck = precheck  # what can be refused before the body is read
        self.unreachable = unreachable  # has this head failed to dial the node at that URL (while it announces)?
        self.log_limit = LogLimiter(log)
        self.insecure = insecure  # no secret, beyond loopback: every join is said out loud
        registry.on_expire = self._expired  # whoever notices a silent node first, it leaves the same way

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/mesh/join", self.join)
        app.router.add_post("/mesh/leave", self.leave)

    async def expiry_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """Drop nodes whose heartbeats stopped, while the app runs (an aiohttp cleanup context)."""
        task = asyncio.create_task(self._expire_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _checked_body(self, request: web.Request) -> tuple[Any, str, web.Response | None]:
        """The request's JSON and the node key it proves if it may come in, else the refusal to answer with."""
        refusal = self.precheck(request)
        if not refusal and (request.content_length or 0) > MAX_BODY_BYTES:
            return None, "", _refused(f"a /mesh body is at most {MAX_BODY_BYTES} bytes", 413)
        try:
            body = b"" if refusal else await _read_capped(request, MAX_BODY_BYTES + 1)
        except TimeoutError:
            return None, "", _refused(f"the body took over {BODY_SECONDS:g} s to arrive", 408)
        if len(body) > MAX_BODY_BYTES:
            return None, "", _refused(f"a /mesh body is at most {MAX_BODY_BYTES} bytes", 413)
        refusal = refusal or self.authorize(request, body)
        key, refusal = ("", refusal) if refusal else self.identify(request, body)
        if refusal:
            self.log_limit.log("refused", logging.WARNING, "refused %s from %s: %s", request.path, request.remote,
                               refusal)
            return None, "", _refused(refusal, 401)
        try:
            return orjson.loads(body), key, None
        except orjson.JSONDecodeError as exc:
            return None, "", _refused(f"the body is not JSON: {exc}", 400)

    def _bound(self, url: str) -> NodeRecord | None:
        """The live registration for `url`, if any."""
        return next((r for r in self.registry.nodes() if r.url == url), None)

    async def join(self, request: web.Request) -> web.Response:
        data, key, refusal = await self._checked_body(request)
        if refusal is not None:
            return refusal
        try:
            record = _record(data)
            if record.url == self.reserved:
                return _refused(f"{record.url} is this head's --peer; it is not joined", 409)
            bound_key = self.registry.bound_key(record.url)
            if bound_key is not None and bound_key != key:
                self.log_limit.log("taken", logging.WARNING, "refused a join for %s from %s: another key",
                                   record.url, request.remote)
                return _refused(f"{record.url} is bound to another node key; a registration is not taken over (it "
                                f"ends when that node leaves, or {BIND_GRACE:g} s after it stops answering)", 409)
            record.key = key
            known = self._bound(record.url) is not None
            if not known and (len(self.registry.nodes()) >= MAX_NODES or self.registry.crowded):
                return _refused(f"the registry is full ({MAX_NODES} nodes)", 503)
            if not known and key and sum(r.key == key for r in self.registry.nodes()) >= URLS_PER_KEY:
                return _refused(f"this node key has {URLS_PER_KEY} addresses joined already", 429)
            self.registry.announce(record)
        except (ValueError, TypeError, KeyError) as exc:
            return _refused(f"bad join: {exc}", 400)
        if self.insecure:
            log.warning("INSECURE: %s joined with no mesh secret; anyone who reaches this port can do the same",
                        record.url)
        if not known:
            log.info("node %s joined: %s layers %d-%d", record.node, record.url, record.layers[0], record.layers[1] - 1)
            self.on_join(record)
        answer: dict[str, Any] = {"ok": True, "ttl": self.registry.ttl}
        instruction = self.instruction(record.url) if record.auto else None
        if instruction is not None:
            answer["plan"] = instruction
        nodes = [node for node in self.registry.nodes() if node.url != record.url]
        if self.unreachable(record.url):  # alive (it just announced) yet not dialable: it dials in (mesh.reverse)
            before = [node.url for node in nodes if node.layers[1] == record.layers[0]][:16]
            after = [node.url for node in nodes if node.layers[0] == record.layers[1]][:16]
            stuck = {url for url in before + after if self.unreachable(url)}  # neither side can dial: relayed
            answer.update(unreachable=True, dial_in=[url for url in before if url not in stuck],
                          relay_for=[url for url in before if url in stuck],
                          relay=[url for url in after if url in stuck])
            # The keys of the nodes it dials in to (their challenges must name them) and of the other ends of its
            # relayed hops (they seal them: `mesh.seal`).
            answer["keys"] = {node.url: node.key for node in nodes if node.url in before + after and node.key}
        else:  # the nodes after it that were told to dial into it (above), and the keys they must prove
            answer["dial_ins"] = [{"url": node.url, "key": node.key} for node in nodes
                                  if node.layers[0] == record.layers[1] and self.unreachable(node.url)][:16]
        return web.json_response(answer)

    async def leave(self, request: web.Request) -> web.Response:
        data, key, refusal = await self._checked_body(request)
        if refusal is not None:
            return refusal
        url = data.get("url") if isinstance(data, dict) else None
        if not isinstance(url, str):
            return _refused("bad leave: send {\"url\": ...}", 400)
        url = url.rstrip("/")
        bound_key = self.registry.bound_key(url)
        if bound_key is not None and bound_key != key:
            return _refused(f"{url} is bound to another node key: only that node may leave in its name", 403)
        if self.registry.leave(url):
            log.info("node at %s left", url)
            self.on_leave(url)
        return web.json_response({"ok": True})

    def check_link(self, url: str, model: str, layers: tuple[int, int]) -> bool:
        """A joined node's link said who it is: drop its record unless that is what it claimed."""
        record = next((r for r in self.registry.nodes() if r.url == url), None)
        if record is None or (record.layers == layers and model == self.registry.model):
            return True
        if record.auto and layers == self.expected(url) and model == self.registry.model:
            record.layers = layers  # moved as the plan says, before its heartbeat said so
            return True
        log.warning("node at %s claimed layers %s but its link says %s of %s; dropped", url, list(record.layers),
                    list(layers), model)
        self.registry.leave(url, keep_binding=True)
        self.on_leave(url)
        return False

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.registry.expire()

    def _expired(self, record: NodeRecord) -> None:
        log.warning("node %s (%s) stopped answering; removed from the registry", record.node, record.url)
        self.on_leave(record.url)


def _refused(why: str, status: int) -> web.Response:
    return web.json_response({"error": why}, status=status)


def _record(data: Any) -> NodeRecord:
    """A join's body, checked field by field; ValueError names the field."""
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    url, model, layers = data.get("url"), data.get("model"), data.get("layers")
    if not isinstance(url, str) or not url.startswith(("ws://", "wss://")) or len(url) > 512:
        raise ValueError("url must be a ws:// or wss:// address")
    if not isinstance(model, str) or len(model) > 512:
        raise ValueError("model must be a string")
    if not (isinstance(layers, list) and len(layers) == 2 and all(_is_int(n) for n in layers)):
        raise ValueError("layers must be [start, end]")
    node = data.get("node", url)
    role = data.get("role", "tail")
    if not isinstance(node, str) or len(node) > 512:
        raise ValueError("node must be a string")
    if role not in ("middle", "tail"):
        raise ValueError("role must be middle or tail")
    draining, auto = data.get("draining", False), data.get("auto", False)
    if not isinstance(draining, bool) or not isinstance(auto, bool):
        raise ValueError("draining and auto must be true or false")
    roles = data.get("roles", ["middle", "tail"])
    if not isinstance(roles, list) or not roles or not set(roles) <= {"middle", "tail"} or len(roles) > 2:
        raise ValueError("roles must list middle, tail or both")
    record = NodeRecord(url=url.rstrip("/"), node=node, model=model, layers=(layers[0], layers[1]), role=role,
                        capacity=_count(data, "capacity"), load=_count(data, "load"), draining=draining, auto=auto,
                        roles=tuple(dict.fromkeys(roles)))
    measured = data.get("measured")
    if measured is not None:
        if not isinstance(measured, dict):
            raise ValueError("measured must be an object")
        record.layer_seconds = _measure(measured, "layer_ms", 1e-6, MAX_LAYER_MS) / 1000
        record.link_seconds = _measure(measured, "link_ms", 0.0, MAX_LINK_MS, default=0.0) / 1000
        if measured.get("lm_head_ms") is not None:
            record.lm_head_seconds = _measure(measured, "lm_head_ms", 1e-6, MAX_LAYER_MS) / 1000
        memory = measured.get("memory")
        if memory is not None and (not _is_int(memory) or not 0 < memory <= MAX_MEMORY):
            raise ValueError(f"measured.memory must be a whole number of bytes in (0, {MAX_MEMORY}]")
        record.memory = memory
        if measured.get("busy") is not None:
            record.busy = _measure(measured, "busy", 0.0, 1.0)
    plan = data.get("plan", {})
    if not isinstance(plan, dict):
        raise ValueError("plan must be an object")
    epoch = plan.get("epoch", "")
    if not isinstance(epoch, str) or len(epoch) > 64:
        raise ValueError("plan.epoch must be a short string")
    record.epoch = epoch
    for name in ("serving", "prepared"):
        value = plan.get(name, 0)
        if not _is_int(value) or not 0 <= value <= MAX_VERSION:
            raise ValueError(f"plan.{name} must be a plan version (a whole number >= 0)")
        setattr(record, name, value)
    return record


def _measure(data: dict[str, Any], name: str, least: float, most: float, default: float | None = None) -> float:
    """A measured figure: finite, within [least, most] (a join claiming an impossible speed is refused)."""
    value = data.get(name, default)
    if value is None:
        raise ValueError(f"measured.{name} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not least <= value <= most:
        raise ValueError(f"measured.{name} must be a finite number in [{least:g}, {most:g}], not {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(data: dict[str, Any], name: str) -> int:
    """A non-negative, finite count (load, capacity), clamped to MAX_LOAD."""
    value = data.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0")
    return min(int(value), MAX_LOAD)


async def _read_capped(request: web.Request, limit: int) -> bytes:
    """The body, to its end or `limit` bytes (one read returns only what has arrived: a body in several segments)."""
    body = bytearray()
    async with asyncio.timeout(BODY_SECONDS):  # (a sender that stalls does not hold the handler)
        while len(body) < limit:
            chunk = await request.content.read(limit - len(body))
            if not chunk:
                break
            body += chunk
    return bytes(body)
