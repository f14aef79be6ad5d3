"""What a node reports about itself: `/health` (JSON), `/metrics` (Prometheus), a log line per generation,
and the batching hints its compute worker asks for.

`NodeReports` is a part of `meshws.node.Node` kept in its own file: it only reads the
node's parts (shard, links, head, registry, shard service) and never changes them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from . import heap
from .api.errors import json_response, public_text
from .head.generation import GenerationStats
from .head.routes import NoRoute, chain_gaps
from .mesh.wire import ChainHop
from .model.memory import process_memory

log = logging.getLogger("meshws.node")

MAX_HOP_LABELS = 16  # hops of a route /metrics names one by one (the label's values stay few)


class NodeReports:
    """/health, /metrics and generation logs of a node (mixed into `Node`, which owns every attribute used)."""

    def health(self) -> dict[str, Any]:
        backend = self.shard
        chain, problems = self._chain_state()
        draining = self.head is not None and self.head.queue.draining
        reasons = problems + (["draining: the node is stopping and takes no new requests"] if draining else [])
        info: dict[str, Any] = {
            "status": "unavailable" if reasons else "ok",
            "role": self.role,
            "node": self.name,
            "model": backend.model_id,
            "layers": list(self.span),
            "total_layers": backend.total_layers,
            "sessions": len(backend.sessions),
            "cache_bytes": backend.sessions.total_bytes,
            "prefixes": backend.sessions.prefixes,  # shared prompt prefixes held, apart from "sessions"
            "standbys": backend.sessions.apart("standby"),  # copies of sessions other nodes serve (`mesh.standby`)
            "weight_bytes": backend.weight_bytes,  # what this node's layers cost, and the process in all
            "weights": backend.weight_facts(),  # mapped from the GGUF, resident now, per block type
            **process_memory(),  # resident_bytes, peak_resident_bytes
            "supports_kv_cache": backend.supports_kv_cache,
            "compute": {**backend.compute_facts, **(self.cores.describe() if self.cores else {}),
                        "busy_seconds": round(self.worker.busy_seconds, 3), "work": self.worker.counts(),
                        "busy_share": self.metrics.busy.now() if self.metrics.busy else None,  # of the last seconds
                        "waves": {"groups": self._micro_batches(), "whole": self._one_wave()},  # (`mesh.waves`)
                        # (start, end, rows) of the last jobs, on this host's monotonic clock
                        "recent_steps": [[round(a, 4), round(b, 4), rows] for a, b, rows in list(self.worker.recent)]},
            "heap": heap.describe(),  # objects kept out of the garbage collector; its pauses since
            "capacity": self.capacity.describe(),  # measured speed, memory budget, link: what placement weighs
            "identity": {"fingerprint": self.access.identity.fingerprint} if self.access.identity else None,
            "links": [link.describe() for link in self.links.all()],
            "chain": chain,
            "problems": reasons,
            "ready": not reasons,
            "uptime_s": round(time.time() - self.started, 1),
        }
        if self.shard_service is not None:
            info["inbound_links"] = len(self.shard_service.inbound)
            info["channels"] = len(self.shard_service.sessions)
            info["pending_tasks"] = len(self.shard_service.pending_tasks)
        if self.head is not None:
            queue = self.head.queue
            info.update(generations=self.head.generations, queued=self.head.queued,
                        longest_wait_s=round(queue.longest_wait, 2), max_generations=queue.slots,
                        max_queue=queue.max_queue, draining=queue.draining,
                        # sessions kept open between answers, apart from generating ones
                        kept_sessions={"conversations": self.head.conversations - len(self.head.warm)
                                       - len(self.head.prefixes), "warm": len(self.head.warm),
                                       "warm_limit": self.head.warm.size, "prefixes": self.head.prefixes.describe()})
            info["recent_laps"] = self.recent_laps.view()  # each link's share of a lap, each shard's load
            info["failovers"] = self.failover_totals  # answers' lost hops, resumed on standbys, positions run again
        if self.registry is not None:
            info["nodes"] = [record.describe() for record in self.registry.nodes()]
        if self.placement is not None:
            info["plan"] = self.placement.describe()  # which node serves which layers, and moves
        if self.follower is not None:
            info["placement"] = {"auto": True, "serving_plan": self.follower.serving, "moving": self.follower.moving}
        if self.announcer is not None:
            info["joined"] = self.announcer.joined  # every head named by --join took the last heartbeat
            info["joined_heads"] = sorted(self.announcer.joined_heads)
            if self.announcer.reverse is not None:  # hops that could not dial this node: it dials them
                info["dialing_in"] = self.announcer.reverse.describe()
        return info

    def _chain_state(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The chain to show (the route a generation would take now, on a head) and its problems (on a head that
        places layers, what its plan cannot serve first)."""
        if self.planner is not None:
            placement = self.placement
            missing = [f"plan: {placement.live.missing}"] if placement is not None and placement.active \
                and placement.live is not None and placement.live.missing else []
            try:
                return self.planner.plan().view, missing
            except NoRoute as exc:
                return [ChainHop(node=self.name, layers=self.span).to_wire()], missing + [str(exc)]
        chain = self.chain()
        problems = chain_gaps([hop.layers for hop in chain], self.shard.total_layers, start=self.span[0])
        if self.settings.peer and self.role == "middle":
            link = self.links.get(self.settings.peer)
            if not link.is_up:
                problems.insert(0, f"next hop {link.url} is {link.status()}")
        return [hop.to_wire() for hop in chain], problems

    async def _health(self, request: web.Request) -> web.Response:
        """200 while the node can serve, 503 with the reasons while it cannot (a gap in the layers, a next hop
        down, draining): what load balancers and Docker's HEALTHCHECK go by. (Until its model is loaded a node
        does not listen at all.)"""
        info = self.health()
        status = 200 if info["ready"] else 503
        if self.access.detail_allowed(request):
            return json_response(info, status=status)
        public = {"status": info["status"], "ready": info["ready"],
                  "problems": [public_text(p) for p in info["problems"]],
                  "role": self.role, "model": self.shard.model_id, "layers": list(self.span)}
        if self.head is not None:  # what a load balancer weighs heads by
            public.update(generations=self.head.generations, queued=self.head.queued)
        return json_response(public, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    def _refused(self, reason: str) -> None:
        self.metrics.admission_refused.labels(reason).inc()

    def _generation_finished(self, stats: GenerationStats, outcome: str) -> None:
        if stats.internal:
            return
        metrics = self.metrics
        metrics.generations.labels(outcome).inc()
        metrics.generated_tokens.inc(stats.completion_tokens)
        metrics.prompt_tokens.inc(stats.prompt_tokens)
        if stats.failovers:
            totals = self.failover_totals
            totals["failovers"] += stats.failovers
            totals["standby_resumes"] += stats.standby_resumes
            totals["recomputed_tokens"] += stats.recomputed_tokens
            metrics.failovers.labels("standby").inc(stats.standby_resumes)
            metrics.failovers.labels("prefill").inc(stats.failovers - stats.standby_resumes)
            metrics.failover_tokens.inc(stats.recomputed_tokens)
        if stats.time_to_first_token is not None:
            metrics.first_token_seconds.observe(stats.time_to_first_token)
        for gap in stats.token_gaps:
            metrics.inter_token_seconds.observe(gap)
        if stats.finished_at is not None:
            metrics.request_seconds.observe(stats.finished_at - stats.started)
        times = stats.times
        self.metrics.lap_seconds.labels("head").inc(times.head_ms / 1000)
        self.metrics.lap_seconds.labels("network").inc(times.network_ms / 1000)
        for index, ms in enumerate(list(times.hop_ms.values())[:MAX_HOP_LABELS], 1):
            self.metrics.lap_seconds.labels(f"hop{index}").inc(ms / 1000)
        for index, (link, ms) in enumerate(list(times.link_ms.items())[:MAX_HOP_LABELS], 1):
            self.metrics.lap_seconds.labels(f"link{index}").inc(ms / 1000)
        self.recent_laps.note(times)
        drafts = stats.speculation
        if drafts is not None:
            self.metrics.laps.inc(drafts.laps)
            self.metrics.draft_tokens.labels("accepted").inc(drafts.accepted)
            self.metrics.draft_tokens.labels("rejected").inc(drafts.drafted - drafts.accepted)
        ttft = stats.time_to_first_token
        log.info(
            "generation %s %s: %d prompt + %d completion tokens, ttft %s, %.1f tok/s, %d prefill(s), %d cache misses",
            stats.sid[:12], outcome, stats.prompt_tokens, stats.completion_tokens,
            f"{ttft * 1000:.0f} ms" if ttft is not None else "-", stats.decode_tokens_per_second or 0.0,
            stats.prefills, stats.cache_misses,
        )

    # -- batching hints (`mesh.compute`, `mesh.waves`) -------------------------------

    def _micro_batches(self) -> int:
        """Decode groups a head keeps in flight: one per shard of its chain, so every shard has one to compute;
        one wave where this host's nodes lend each other their cores (`waves`)."""
        if self.role != "head" or self._one_wave():
            return 1  # later shards compute groups as they arrive; a full node has no one to overlap with
        return max(2, len(self.chain())) if self.settings.peer else 2

    def _one_wave(self) -> bool:
        """A head sharing this host's cores with other meshws nodes (its later shards, as `meshws mesh` starts
        them): the whole batch on every core in turn beats a group per node on one core each (`waves`)."""
        return self.role == "head" and self.cores is not None and self.cores.nodes > 1

    def _live_sessions(self) -> int:
        """Sessions that may send a decode step soon (a batching hint for the worker)."""
        if self.head is not None:
            return self.head.generations
        if self.shard_service is not None:
            return len(self.shard_service.sessions)
        return 1
