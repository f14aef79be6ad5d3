"""One meshws node: `python -m meshws.node --role tail --layers 15-29 --port 8702` (or `meshws node ...`).

This module only wires the parts for a role: it loads the shard, binds the port, and mounts `/health` and
`/metrics` everywhere, `/ws/shard` on middle and tail nodes, and on head and full nodes the public API, `/ws/chat`,
the chat page and the registry. Each background part's start and stop sit together in one `cleanup_ctx` generator;
`aiohttp` runs the stops in reverse order. Once loaded, the heap is frozen out of the garbage collector (`heap`).
SIGTERM drains first (`Node.shutdown`): no new connections, running work finishes within `--drain-timeout`, then
sessions, links and the HTTP runner close, in that order.
"""

from __future__ import annotations

import sys

from . import early  # (no torch: before the imports below)

if __name__ == "__main__":  # the kernels compile (a first start) and a head's tokenizer builds while torch imports
    early.start(sys.argv[1:])

import asyncio
import functools
import logging
import signal
import socket
import time
from typing import Any, AsyncIterator

from aiohttp import web

from . import heap
from .api.chat_ws import ChatSocket
from .api.errors import error_middleware
from .api.guards import RequestGuard, add_security_headers
from .api.openai_routes import OpenAIApi
from .api.page import add_page_routes
from .access import NodeAccess, tls_contexts
from .config import NodeSettings, parse_settings
from .cores import CoreShare
from .head.membership import RegistryEndpoints
from .head.planner import RoutePlanner
from .head.rebalance import Placement
from .head.registry import Registry
from .head.service import HeadService, build_head
from .head.timing import RecentLaps
from .loading import check_role, load_backend
from .mesh.addresses import host_of, is_loopback
from .mesh.aio import until
from .mesh.auth import CHALLENGE_PATH
from .mesh.compute import ComputeWorker
from .mesh.inbound import ShardLimits
from .mesh.link import Link
from .mesh.link_pool import LinkPool
from .mesh.membership import Announcer
from .mesh.metrics import BusyShare, NodeMetrics
from .mesh.reverse import ReverseDialer, ReverseEndpoint, cannot_dial
from .mesh.shard_service import ShardService
from .mesh.wire import ChainHop, Hello
from .model.kernels import blas
from .model.backend import ShardBackend
from .placement import ROLES, NodeCapacity, PlanFollower, budget_problem, head_placement
from .reports import NodeReports

log = logging.getLogger("meshws.node")


class Node(NodeReports):
    def __init__(self, settings: NodeSettings, backend: ShardBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.cores: CoreShare | None = None  # this host's cores, shared with its other nodes
        self.auto = settings.layers == "auto"  # placed by the head's plan (a head: placing itself too)
        self.role = "middle" if self.auto and settings.role != "head" else settings.role  # (until placed)
        self.started = time.time()
        self.recent_laps = RecentLaps()  # what the last answers found on the route (links' times, shards' loads)
        self.failover_totals = {"failovers": 0, "standby_resumes": 0, "recomputed_tokens": 0}  # (`reports`)
        self.port: int | None = None
        self.advertise = ""
        self.access = NodeAccess(settings)
        self.server_ssl, self.client_ssl = tls_contexts(settings)
        self.links = LinkPool(self._new_link)
        self.shard_service: ShardService | None = None
        self.head: HeadService | None = None
        self.planner: RoutePlanner | None = None
        self.registry: Registry | None = None
        self.placement: Placement | None = None  # a head's: the plan in force, and moves
        self.follower: PlanFollower | None = None  # an automatic node's side of it
        self.announcer: Announcer | None = None
        self.registry_endpoints: RegistryEndpoints | None = None
        self.reverse_endpoint: ReverseEndpoint | None = None  # a head's or middle's: sockets dialed in from nodes
        self._runner: web.AppRunner | None = None
        self.hurry = asyncio.Event()  # set by a second SIGTERM/SIGINT: cut the drain short
        self.draining = False  # SIGTERM: finish what runs, take nothing new

    @property
    def name(self) -> str:
        return f"{self.role}@{self.settings.host}:{self.port or self.settings.port}"

    @property
    def shard(self) -> ShardBackend:
        """The loaded shard (after `start`)."""
        if self.backend is None:
            raise RuntimeError("the node has not loaded its shard yet")
        return self.backend

    @property
    def span(self) -> tuple[int, int]:
        return (self.shard.start, self.shard.end)

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> int:
        if self.backend is None:
            if self.settings.threads is None:  # nodes on this host split its cores (`cores`)
                try:
                    self.cores = CoreShare()
                except OSError as exc:
                    log.warning("not sharing this host's cores with other nodes: %s", exc)
            first = ((0, 1) if self.role == "head" else (1, 2)) if self.auto else None  # then: the plan's
            self.backend = await asyncio.to_thread(load_backend, self.settings, self.cores and self.cores.threads,
                                                   first)
            problem = "" if self.auto else check_role(self.role, self.backend)
            if not problem and self.settings.memory is not None and self.backend.costs is not None:
                problem = budget_problem(self.backend.costs, self.settings.memory, None if self.auto else self.span,
                                         ROLES[self.settings.role] if self.auto else ())
            if problem:
                raise SystemExit(problem)
        self.capacity = NodeCapacity(self)
        sock = socket.create_server((self.settings.host, self.settings.port))
        self.port = sock.getsockname()[1]  # the real port when 0 was asked
        scheme = "wss" if self.server_ssl else "ws"
        self.advertise = self.settings.advertise or f"{scheme}://{self._public_host()}:{self.port}"
        self.worker = ComputeWorker(self.backend, live_sessions=self._live_sessions,
                                    prefill_chunk=self.settings.prefill_chunk,
                                    # the compute thread takes the threads (torch counts them per thread)
                                    retune=self.cores.retune if self.cores else functools.partial(
                                        blas.set_threads, self.settings.threads or blas.threads()),
                                    micro_batches=self._micro_batches, rest=self.cores.rest if self.cores else None,
                                    whole_wave=self._one_wave, timed=self.capacity.step_timed)
        sessions = self.backend.sessions
        self.metrics = NodeMetrics(sessions=lambda: len(sessions), cache_bytes=lambda: sessions.total_bytes,
                                   weight_bytes=lambda: self.shard.weight_bytes, weights=self.backend.weight_facts)
        self.metrics.watch_compute(lambda: self.worker.queued, lambda: self.worker.busy_seconds,
                                   BusyShare(lambda: self.worker.recent, self.worker.recent.maxlen or 1))
        guard = RequestGuard([self.settings.host, self._public_host(), host_of(self.advertise)],
                             self.settings.allowed_hosts, self.settings.cors_origins,
                             mesh_hosts_checked=not self.settings.secret)
        app = web.Application(client_max_size=8 * 1024 * 1024,
                              middlewares=[guard.middleware(), error_middleware(lambda: self.settings.api_key)])
        app.on_response_prepare.append(add_security_headers)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get(CHALLENGE_PATH, self.access.challenge)
        app.cleanup_ctx.append(self._worker_ctx)
        app.cleanup_ctx.append(self._links_ctx)
        app.cleanup_ctx.append(self.capacity.probe_ctx)  # (a speed before joining or planning)
        if self.role in ("middle", "tail"):
            self._mount_shard_service(app)
        if self.role in ("head", "full"):
            self._mount_head(app)
        if self.role in ("head", "middle"):  # a node after this one may not be dialable: it dials in
            self.reverse_endpoint = ReverseEndpoint(
                self.links, lambda request: self.access.authorize(request, b""), self.settings.max_frame_bytes,
                self.registry and self.registry.spans, self.metrics.frame_bytes.labels("relayed", "relay").inc,
                identify=lambda request: self.access.identify(request, b""),
                keys=self.registry.key_of if self.registry else lambda url: None)
            self.reverse_endpoint.add_routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=10.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self.server_ssl).start()
        return self.port

    async def shutdown(self) -> None:
        """SIGTERM: accept nothing new, let running work finish within --drain-timeout, then `stop`."""
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()  # no new connections; a load balancer sees this node go
        self.draining = True
        if self.head is not None:
            self.head.queue.drain()  # those still waiting (and new requests on kept-alive connections): 503
        if self.shard_service is not None:
            self.shard_service.draining = True  # new sessions over the heads' links are refused as lost
        if self.announcer is not None:
            await self.announcer.announce_now()  # heads stop routing new sessions here
        busy = self._busy()
        if busy:
            log.info("%s draining: waiting up to %g s for %d running", self.name, self.settings.drain_timeout, busy)
        if not await until(lambda: not self._busy() or self.hurry.is_set(), self.settings.drain_timeout) \
                or self._busy():
            log.warning("%s: %d still running (drain over: timed out or cut short); closing them", self.name,
                        self._busy())
        await self.stop()

    async def stop(self) -> None:
        """Close sessions (their releases still reach the shards), then links, then the HTTP runner."""
        if self._runner is None:
            return
        if self.head is not None and self.head.generations:  # cancelled again until gone: a cancel can be lost
            await until(lambda: not self.head or not self.head.queue.cancel_running(), 5.0)
        if self.announcer is not None:
            await self.announcer.stop()
        await self.links.close()
        await self._runner.cleanup()
        self._runner = None

    def _busy(self) -> int:
        """Generations this head runs, or sessions this shard holds for the hops before it."""
        if self.head is not None:
            return self.head.generations
        return len(self.shard_service.sessions) if self.shard_service is not None else 0

    async def _worker_ctx(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(self.worker.shutdown)
        released = self.shard.sessions.clear()
        if self.cores is not None:
            self.cores.close()
        log.info("%s stopped (%d cached sessions released)", self.name, released)

    async def _links_ctx(self, app: web.Application) -> AsyncIterator[None]:
        if self.settings.peer and self.role in ("head", "middle"):
            self.links.get(self.settings.peer)  # dialed now, re-dialed while the node runs
        yield
        await self.links.close()

    def _mount_shard_service(self, app: web.Application) -> None:
        """/ws/shard: the session channels of the hop before this one; and joining a head."""
        service = self.shard_service = ShardService(
            self.shard, self.worker, self.links, self.metrics,
            node_name=self.name, hello=self.hello, static_peer=self.settings.peer,
            max_frame_bytes=self.settings.max_frame_bytes, compress_min_bytes=self.settings.compress_min_bytes,
            authorize=lambda request: self.access.authorize(request, b""), secret=self.settings.secret,
            open_routes=self.settings.insecure, limits=ShardLimits(
                self.settings.max_link_sessions, self.settings.max_link_frames, self.settings.step_timeout),
        )
        service.url = self.advertise  # a draining refusal names this node, so a head avoids it alone
        app.router.add_get("/ws/shard", service.handle)
        app.cleanup_ctx.append(service.next_hops.idle_ctx)
        app.on_shutdown.append(lambda app: service.shutdown())
        if self.settings.join:
            app.cleanup_ctx.append(self._announcer_ctx)

    async def _announcer_ctx(self, app: web.Application) -> AsyncIterator[None]:
        assert self.shard_service is not None
        reverse = ReverseDialer(lambda: self.advertise, self.shard_service.serve_link, self.settings.secret,
                                self.client_ssl, self.settings.max_frame_bytes, self.links, self.access.identity)
        follower = self.follower = PlanFollower(self) if self.auto else None
        self.announcer = Announcer(self.settings.join or "", self._announcement, self.settings.secret,
                                   self.client_ssl, reverse, on_answer=follower.heard if follower else lambda _: None,
                                   on_round_trip=self.capacity.round_trip,
                                   hurry=lambda: bool(follower and follower.moving), identity=self.access.identity,
                                   # (a middle: its heads name the nodes that dial into it, and their keys)
                                   expect=self.reverse_endpoint.expect if self.reverse_endpoint else lambda _: None)
        self.announcer.start()
        yield
        await self.announcer.stop()

    def _mount_head(self, app: web.Application) -> None:
        """The head's surfaces: the OpenAI API, /ws/chat, the chat page, and the registry."""
        backend = self.shard
        self.registry = Registry(backend.model_id, backend.total_layers, ttl=self.settings.registry_ttl)
        self.planner = RoutePlanner(self.name, lambda: self.span, backend.total_layers, backend.model_id, self.links,
                                    self.registry, self.settings.peer, full=self.role == "full",
                                    standbys=self.settings.standby == "auto")
        self.head = build_head(backend, self.worker, self.planner, self.settings, self._generation_finished)
        if self.role == "head" and backend.costs is not None:
            placement = self.planner.placement = self.placement = head_placement(self, self.capacity)
            app.cleanup_ctx.append(placement.run_ctx)
        queue = self.head.queue
        app.cleanup_ctx.append(self.head.warm_ctx)
        self.metrics.watch_reuse(lambda: self.head.reuse, lambda: self.head.warm.evictions)
        self.metrics.watch_admission(lambda: queue.running, lambda: queue.waiting)
        queue.on_wait, queue.on_refuse = self.metrics.queue_wait_seconds.observe, self._refused
        OpenAIApi(self.head, self.settings.write_timeout, self.settings.sse_ping).add_routes(app)
        chat = ChatSocket(self.head, self.access.detail_allowed, self.settings.write_timeout)
        chat.add_routes(app)
        app.on_shutdown.append(lambda app: chat.shutdown())
        if not add_page_routes(app):
            log.warning("the chat page is not installed with this package; / is not served")
        endpoints = self.registry_endpoints = RegistryEndpoints(
            self.registry, on_join=lambda record: self.links.get(record.url), on_leave=self.links.discard,
            authorize=self.access.authorize, insecure=self.settings.insecure and not self.settings.secret,
            precheck=self.access.precheck, unreachable=functools.partial(cannot_dial, self.links),
            identify=self.access.identify, reserved=(self.settings.peer or "").rstrip("/"),
            **({"instruction": self.placement.instruction, "expected": self.placement.expected}
               if self.placement else {}))
        endpoints.add_routes(app)
        app.cleanup_ctx.append(endpoints.expiry_ctx)

    def _public_host(self) -> str:
        host = self.settings.host
        return socket.gethostname() if host in ("0.0.0.0", "::", "") else host

    def _announcement(self) -> dict[str, Any]:
        sessions = len(self.shard.sessions)
        return {"url": self.advertise, "node": self.name, "model": self.shard.model_id,
                "layers": list(self.span), "role": self.role, "load": sessions, "draining": self.draining,
                "capacity": max(0, self.settings.max_sessions - sessions), "measured": self.capacity.measured(),
                **(self.follower.report() if self.follower else {})}

    # -- links and the chain --------------------------------------------------

    def _new_link(self, url: str) -> Link:
        return Link(url, self.hello, max_frame_bytes=self.settings.max_frame_bytes, on_change=self._link_changed,
                    secret=self.settings.secret, ssl=self.client_ssl, identity=self.access.identity)

    def _link_changed(self, link: Link) -> None:
        if self.shard_service is not None:  # our chain changed: tell the hop before us
            asyncio.get_running_loop().create_task(self.shard_service.announce())
        hello = link.peer_hello
        if self.registry_endpoints is not None and link.is_up and hello is not None:
            self.registry_endpoints.check_link(link.url, hello.model, hello.layers)

    def hello(self) -> Hello:
        backend = self.shard
        return Hello(model=backend.model_id, layers=self.span, role=self.role, node=self.name,
                     total_layers=backend.total_layers, chain=tuple(self.chain()))

    def chain(self) -> list[ChainHop]:
        """This node and the static chain behind it, as far as its links know."""
        own = [ChainHop(node=self.name, layers=self.span)]
        if not self.settings.peer or self.role in ("tail", "full"):
            return own
        link = self.links.get(self.settings.peer)
        if not link.is_up or link.peer_hello is None:
            return own
        return own + list(link.peer_hello.chain)


async def serve(settings: NodeSettings) -> None:
    node = Node(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = await node.start()
    log.debug("%d loaded objects frozen out of the garbage collector", heap.freeze())
    if settings.insecure and not settings.secret and not is_loopback(settings.host):
        log.warning("INSECURE: listening on %s with no mesh secret: anyone who reaches this port can link to this "
                    "node, join the mesh and read every hidden state; use --secret-file", settings.host)
    where = f"{'https' if node.server_ssl else 'http'}://{settings.host}:{port}"
    first, last = node.span
    line = f"meshws {node.role} ready: {node.shard.model_id} layers {first}-{last - 1} on {where}"
    if node.role in ("head", "full"):
        line += f" (chat page {where}/, OpenAI API {where}/v1)"
    else:
        line += f" (links: {node.advertise}/ws/shard)"
    print(line, flush=True)
    await stop.wait()
    log.info("%s shutting down (again to skip the drain)", node.name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.hurry.set)
    await node.shutdown()


def main(argv: list[str] | None = None, prog: str = "python -m meshws.node") -> None:
    settings = parse_settings(argv, prog=prog)
    logging.basicConfig(level=getattr(logging, settings.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
