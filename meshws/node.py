"""One meshws node: `python -m meshws.node --role tail --layers 15-29 --port 8702`.

A node loads its shard, listens on HTTP, and wires the parts together:
`/health` and `/metrics` everywhere, `/ws/shard` on middle and tail nodes,
the public API, `/ws/chat` and the chat page on head and full nodes, and a
persistent link to the next hop (`--peer`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from .auth import HEADER, Verifier, sign
from .chat_ws import ChatSocket
from .compute import ComputeWorker
from .config import NodeSettings, parse_settings
from .generation import GenerationStats, Generator, PipelineError
from .link import Link, LinkPool
from .metrics import NodeMetrics
from .openai_api import ApiError, OpenAIApi, PromptBuilder, error_middleware, json_response
from .membership import Announcer, RegistryEndpoints, ask_assignment
from .routing import NodeRecord, NoRoute, Registry, Route, chain_gaps, plan_hops
from .shard_server import ShardService
from .wire import hello as hello_frame

log = logging.getLogger("meshws.node")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


def load_backend(settings: NodeSettings) -> Any:
    from .shard import ModelShard, ShardSettings

    start, end = settings.layers if isinstance(settings.layers, tuple) else (0, None)
    shard_settings = ShardSettings(
        dtype=settings.dtype,
        wire_dtype=settings.wire_dtype,
        max_sessions=settings.max_sessions,
        cache_ttl=settings.cache_ttl,
        max_cache_bytes=settings.max_cache_bytes,
        threads=settings.threads,
    )
    return ModelShard(settings.model, start, end, shard_settings, cache_dir=settings.cache_dir)


def check_role(settings: NodeSettings, backend: Any) -> str | None:
    last = backend.total_layers - 1
    if settings.role == "tail" and not backend.is_tail:
        return f"a tail must run through the last layer ({last}); use --layers A-{last}"
    if settings.role == "middle" and backend.is_tail:
        return f"a middle node must stop before the last layer ({last}); this is a tail"
    if settings.role == "head" and backend.is_tail:
        return "this head runs every layer; use --role full"
    return None


class Node:
    def __init__(self, settings: NodeSettings, backend: Any | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.role = settings.role
        self.started = time.time()
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self.generator: Generator | None = None
        self.shard_service: ShardService | None = None
        self.registry: Registry | None = None
        self.registry_endpoints: RegistryEndpoints | None = None
        self.announcer: Announcer | None = None
        self.advertise: str | None = None
        self._inflight: dict[str, int] = {}  # generations routed through each hop, by URL
        self.verifier = Verifier(settings.secret)

    # -- facts used by the parts ---------------------------------------------

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    @property
    def span(self) -> tuple[int, int]:
        return (self.backend.start, self.backend.end)

    @property
    def name(self) -> str:
        return f"{self.role}@{self.settings.host}:{self.port or self.settings.port}"

    @property
    def vocab_size(self) -> int | None:
        return getattr(getattr(self.backend, "config", None), "vocab_size", None)

    @property
    def max_tokens_limit(self) -> int:
        return self.prompt_builder.context_length

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids)

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> int:
        if self.backend is None:
            if self.settings.layers == "auto":
                await self._take_assigned_layers()
            self.backend = await asyncio.to_thread(load_backend, self.settings)
            problem = check_role(self.settings, self.backend)
            if problem:
                raise SystemExit(problem)
        self.worker = ComputeWorker(self.backend, live_sessions=self._live_sessions)
        self.metrics = NodeMetrics(sessions=self._session_count, cache_bytes=self._cache_bytes)
        self.links = LinkPool(self._new_link)
        app = web.Application(
            client_max_size=8 * 1024 * 1024,
            middlewares=[error_middleware(lambda: self.settings.api_key)],
        )
        app.router.add_get("/health", self.health_handler)
        app.router.add_get("/metrics", self.metrics_handler)
        if self.role in ("middle", "tail"):
            self._add_shard_routes(app)
        if self.role in ("head", "full"):
            self._add_public_routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked
        self.advertise = self.settings.advertise or f"ws://{self._public_host()}:{self.port}"
        if self.settings.peer and self.role in ("head", "middle"):
            self.links.get(self.settings.peer)
        if self.registry_endpoints is not None:
            self.registry_endpoints.start()
        if self.settings.join:
            self.announcer = Announcer(self.settings.join, self._announcement, headers=self.auth_headers)
            self.announcer.start()
        return self.port

    def _add_shard_routes(self, app: web.Application) -> None:
        """/ws/shard: the session channels of the hop before this one."""
        self.shard_service = ShardService(
            self.backend, self.worker, self.links, self.metrics,
            node_name=self.name, hello=self.hello, static_peer=self.settings.peer,
            max_frame_bytes=self.settings.max_frame_bytes, compress_min_bytes=self.settings.compress_min_bytes,
            authorize=self._authorize,
        )
        app.router.add_get("/ws/shard", self.shard_service.handle)

    def _add_public_routes(self, app: web.Application) -> None:
        """The head's surfaces: the OpenAI API, /ws/chat, the chat page, and the registry."""
        tokenizer = getattr(self.backend, "tokenizer", None)
        context = getattr(self.backend, "context_length", None) or 2048
        self.prompt_builder = PromptBuilder(tokenizer, context)
        self.generator = Generator(
            self.backend, self.worker, plan=self.plan_route,
            step_timeout=self.settings.step_timeout, compress_min_bytes=self.settings.compress_min_bytes,
            on_finish=self._generation_finished,
        )
        self.api = OpenAIApi(self)
        self.api.add_routes(app)
        ChatSocket(self.api).add_routes(app)
        if WEB_DIR.is_dir():
            app.router.add_get("/", self._index)
            app.router.add_static("/static/", WEB_DIR)
        self.registry = Registry(self.model_id, self.backend.total_layers, ttl=self.settings.registry_ttl)
        self.registry_endpoints = RegistryEndpoints(
            self.registry, self.span, on_join=lambda record: self.links.get(record.url),
            on_leave=self.links.discard, authorize=self._authorize,
        )
        self.registry_endpoints.add_routes(app)

    def _public_host(self) -> str:
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            import socket

            return socket.gethostname()
        return host

    async def _take_assigned_layers(self) -> None:
        start, end, total = await ask_assignment(self.settings.join, self.auth_headers)
        self.settings.layers = (start, end)
        self.role = self.settings.role = "tail" if end == total else "middle"
        log.info("the head assigned layers %d-%d: this node is a %s", start, end - 1, self.role)

    def _announcement(self) -> dict[str, Any]:
        sessions = self._session_count()
        return {"url": self.advertise, "node": self.name, "model": self.model_id, "layers": list(self.span),
                "role": self.role, "load": sessions, "capacity": max(0, self.settings.max_sessions - sessions)}

    async def stop(self) -> None:
        if self.announcer is not None:
            await self.announcer.stop()
        if self.registry_endpoints is not None:
            await self.registry_endpoints.stop()
        if self.shard_service is not None:
            await self.shard_service.shutdown()
        await self.links.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.worker.shutdown()
        released = self.backend.sessions.clear() if hasattr(self.backend, "sessions") else 0
        log.info("%s stopped (%d cached sessions released)", self.name, released)

    def _new_link(self, url: str) -> Link:
        return Link(url, self.hello, max_frame_bytes=self.settings.max_frame_bytes, on_change=self._link_changed,
                    headers=lambda: self.auth_headers("/ws/shard"))

    def auth_headers(self, path: str) -> dict[str, str]:
        return {HEADER: sign(self.settings.secret, path)} if self.settings.secret else {}

    def _authorize(self, request: web.Request) -> str | None:
        return self.verifier.check(request.headers.get(HEADER), request.path)

    def _link_changed(self, link: Link) -> None:
        if self.shard_service is not None:  # our chain changed: tell the hop before us
            asyncio.get_running_loop().create_task(self.shard_service.announce())

    # -- the chain ----------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        message = hello_frame(self.model_id, self.span, self.role, self.name)
        message["total_layers"] = self.backend.total_layers
        message["chain"] = self.chain()
        return message

    def chain(self) -> list[dict[str, Any]]:
        """This node and the static chain behind it, as far as its links know."""
        own = [{"node": self.name, "layers": list(self.span)}]
        if not self.settings.peer or self.role in ("tail", "full"):
            return own
        link = self.links.get(self.settings.peer)
        if not link.is_up or not link.peer_hello:
            return own
        return own + list(link.peer_hello.get("chain") or [])

    def _chain_state(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The chain to show (the route a generation would take now, on a head) and its problems."""
        if self.role in ("head", "full"):
            try:
                return self.plan_route(set(), count=False).view, []
            except PipelineError as exc:
                return [{"node": self.name, "layers": list(self.span)}], [str(exc)]
        chain = self.chain()
        problems = chain_gaps([tuple(hop["layers"]) for hop in chain], self.backend.total_layers, start=self.span[0])
        if self.settings.peer and self.role == "middle":
            link = self.links.get(self.settings.peer)
            if not link.is_up:
                problems.insert(0, f"next hop {link.url} is {link.status()}")
        return chain, problems

    def _candidates(self) -> list[NodeRecord]:
        """Nodes a route may use now: joined ones the head can reach, and the --peer chain."""
        records = [r for r in self.registry.nodes() if self.links.get(r.url).is_up] if self.registry else []
        if self.settings.peer:
            link = self.links.get(self.settings.peer)
            chain = (link.peer_hello or {}).get("chain") or []
            if link.is_up and chain:
                span = (chain[0]["layers"][0], chain[-1]["layers"][1])
                if not chain_gaps([tuple(hop["layers"]) for hop in chain], self.backend.total_layers, start=span[0]):
                    records.append(NodeRecord(url=link.url, node=chain[0]["node"], model=self.model_id, layers=span,
                                              role="peer", static=True))
        return records

    def plan_route(self, exclude: set[str], count: bool = True) -> Route:
        """The route of a new generation: fewest hops, then least loaded (full nodes have none)."""
        own = {"node": self.name, "layers": list(self.span)}
        if self.role == "full":
            return Route(None, [], [own])
        candidates = self._candidates()
        try:
            hops = plan_hops(candidates, self.span[1], self.backend.total_layers,
                             load=lambda r: self._inflight.get(r.url, 0) + r.load, exclude=exclude)
        except NoRoute as exc:
            problems = [str(exc)]
            link = self.links.get(self.settings.peer) if self.settings.peer else None
            if link is not None and not link.is_up:
                problems.append(f"next hop {link.url} is {link.status()}")
            raise PipelineError("; ".join(problems)) from exc
        view = [own]
        for hop in hops:
            if hop.static:
                view += (self.links.get(hop.url).peer_hello or {}).get("chain") or []
            else:
                view.append({"node": hop.node, "layers": list(hop.layers), "url": hop.url})
        after = [] if hops[0].static else [{"url": h.url, "layers": list(h.layers)} for h in hops[1:]]
        urls = [hop.url for hop in hops]
        route = Route(self.links.get(hops[0].url), after, view, urls)
        if count:
            for url in urls:
                self._inflight[url] = self._inflight.get(url, 0) + 1
            route.on_done = lambda: self._route_done(urls)
        return route

    def _route_done(self, urls: list[str]) -> None:
        for url in urls:
            self._inflight[url] = max(0, self._inflight.get(url, 0) - 1)

    def check_route(self) -> None:
        """Admission for a new generation: a route must exist and the head must have room."""
        active = len(self.generator.active) if self.generator is not None else 0
        if active >= self.settings.max_generations:
            raise ApiError(503, f"the head is running {active} generations, its limit; retry shortly",
                           code="over_capacity", kind="service_unavailable", headers={"Retry-After": "1"})
        try:
            self.plan_route(set(), count=False)
        except PipelineError as exc:
            raise ApiError(503, str(exc), code="no_route", kind="service_unavailable",
                           headers={"Retry-After": "2"}) from exc

    # -- HTTP ---------------------------------------------------------------

    def _live_sessions(self) -> int:
        """Sessions that may send a decode step soon (a batching hint for the worker)."""
        if self.generator is not None:
            return len(self.generator.active)
        if self.shard_service is not None:
            return len(self.shard_service.sessions)
        return 1

    def _session_count(self) -> int:
        sessions = getattr(self.backend, "sessions", None)
        return len(sessions) if sessions is not None else 0

    def _cache_bytes(self) -> int:
        sessions = getattr(self.backend, "sessions", None)
        return sessions.total_bytes if sessions is not None else 0

    def health(self) -> dict[str, Any]:
        chain, problems = self._chain_state()
        info: dict[str, Any] = {
            "status": "ok",
            "role": self.role,
            "node": self.name,
            "model": self.model_id,
            "layers": list(self.span),
            "total_layers": self.backend.total_layers,
            "sessions": self._session_count(),
            "cache_bytes": self._cache_bytes(),
            "supports_kv_cache": bool(getattr(self.backend, "supports_kv_cache", False)),
            "links": [link.describe() for link in self.links.all()],
            "chain": chain,
            "problems": problems,
            "ready": not problems,
            "uptime_s": round(time.time() - self.started, 1),
        }
        if self.shard_service is not None:
            info["inbound_links"] = len(self.shard_service.inbound)
            info["channels"] = len(self.shard_service.sessions)
            info["pending_tasks"] = len(self.shard_service.pending_tasks)
        if self.generator is not None:
            info["generations"] = len(self.generator.active)
        if self.registry is not None:
            info["nodes"] = [record.describe() for record in self.registry.nodes()]
        if self.announcer is not None:
            info["joined"] = self.announcer.joined
        return info

    async def health_handler(self, request: web.Request) -> web.Response:
        return json_response(self.health())

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB_DIR / "index.html")

    def _generation_finished(self, stats: GenerationStats, outcome: str) -> None:
        self.metrics.generations.labels(outcome).inc()
        self.metrics.generated_tokens.inc(stats.completion_tokens)
        ttft = stats.time_to_first_token
        log.info(
            "generation %s %s: %d prompt + %d completion tokens, ttft %s, %.1f tok/s, %d prefill(s), %d cache misses",
            stats.sid[:12], outcome, stats.prompt_tokens, stats.completion_tokens,
            f"{ttft * 1000:.0f} ms" if ttft is not None else "-", stats.decode_tokens_per_second or 0.0,
            stats.prefills, stats.cache_misses,
        )


async def serve(settings: NodeSettings) -> None:
    node = Node(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = await node.start()
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.secret:
        log.warning("listening on %s without --secret: anyone who can reach this address can link to this node "
                    "or join the mesh", settings.host)
    where = f"http://{settings.host}:{port}"
    first, last = node.span
    line = f"meshws {node.role} ready: {node.model_id} layers {first}-{last - 1} on {where}"
    if node.role in ("head", "full"):
        line += f" (chat page {where}/, OpenAI API {where}/v1)"
    else:
        line += f" (links: ws://{settings.host}:{port}/ws/shard)"
    print(line, flush=True)
    await stop.wait()
    log.info("%s shutting down", node.name)
    await node.stop()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=getattr(logging, settings.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
