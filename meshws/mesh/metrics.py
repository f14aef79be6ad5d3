"""Prometheus metrics of one node (its own registry, so several nodes can share a process).

Besides the traffic, it says what the node costs: the bytes of weights its shard holds
(`meshws_weight_bytes`; a GGUF's tensors as mapped, resident and per block type:
`meshws_weight_mapped_bytes`, `meshws_weight_resident_bytes`, `meshws_weight_type_bytes{type}`) and the
process's resident memory, now and at its peak (`process_resident_memory_bytes` from
prometheus_client, `meshws_peak_resident_bytes`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..model.memory import process_memory

QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


BUSY_WINDOW = 10.0  # seconds a busy share looks back over (at most: the worker keeps its last 128 jobs)
BUSY_FRESH = 0.5  # seconds a busy share is reused (hop reports ask for it every step)


class BusyShare:
    """The share of the recent past a compute worker spent computing: each stage's busy share, which `/health`, the
    heartbeats and the hop reports carry and the chat page shows. From the worker's `recent` jobs (start, end,
    rows) on this host's monotonic clock: over the last BUSY_WINDOW seconds, or since the oldest job kept where
    they do not reach back that far."""

    def __init__(self, recent: Callable[[], Iterable[tuple[float, float, int]]], keeps: int) -> None:
        self._recent, self._keeps = recent, keeps
        self._at, self._share = -BUSY_FRESH, 0.0

    def now(self) -> float:
        now = time.monotonic()
        if now - self._at >= BUSY_FRESH:
            self._at, self._share = now, busy_share(list(self._recent()), now, self._keeps)
        return self._share


def busy_share(jobs: list[tuple[float, float, int]], now: float, keeps: int, window: float = BUSY_WINDOW) -> float:
    since = now - window
    if len(jobs) >= keeps and jobs[0][0] > since:
        since = jobs[0][0]  # (jobs before the oldest kept are not known: the share is of the time they cover)
    busy = sum(min(end, now) - max(start, since) for start, end, _ in jobs if end > since)
    return round(min(1.0, busy / max(now - since, 1e-3)), 3)


class NodeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, sessions: Callable[[], int], cache_bytes: Callable[[], int],
                 weight_bytes: Callable[[], int] = lambda: 0,
                 weights: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.busy: BusyShare | None = None  # the compute worker's recent busy share (`watch_compute`)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, open fds
        PlatformCollector(registry=self.registry)  # python_info
        GCCollector(registry=self.registry)  # python_gc_*
        self.weight_bytes = Gauge("meshws_weight_bytes", "Bytes of the weights this node's shard holds",
                                  registry=self.registry)
        self.weight_bytes.set_function(weight_bytes)  # (read at each scrape: placement may move the layers)
        if weights is not None:  # a GGUF's tensors, mapped: what this node maps, what is resident now, and by type
            self.registry.register(_WeightCollector(weights))
        self.peak_resident_bytes = Gauge("meshws_peak_resident_bytes", "Peak resident memory of this process",
                                         registry=self.registry)
        self.peak_resident_bytes.set_function(lambda: float(process_memory()["peak_resident_bytes"]))
        self.sessions = Gauge("meshws_sessions", "Live KV-cached sessions on this node", registry=self.registry)
        self.sessions.set_function(lambda: float(sessions()))
        self.cache_bytes = Gauge("meshws_cache_bytes", "Bytes held by this node's KV caches", registry=self.registry)
        self.cache_bytes.set_function(lambda: float(cache_bytes()))
        self.steps = Counter("meshws_steps", "Shard steps run", ["mode"], registry=self.registry)
        self.step_seconds = Histogram(
            "meshws_step_seconds", "Time of one shard step", ["mode"], buckets=STEP_BUCKETS, registry=self.registry
        )
        self.frame_bytes = Counter(
            "meshws_frame_bytes", "Websocket bytes by direction and frame type", ["direction", "type"],
            registry=self.registry,
        )
        self.frames = Counter(
            "meshws_frames", "Websocket frames by direction and frame type (in: fwd_wave, a frame of a wave's rows; "
            "out: fwd_decode counts decode steps sent on, alone or as a wave's rows)", ["direction", "type"],
            registry=self.registry,
        )
        self.cache_misses = Counter("meshws_cache_misses", "Steps answered with cache_miss", registry=self.registry)
        self.errors = Counter("meshws_errors", "Error frames sent, by kind", ["kind"], registry=self.registry)
        self.generations = Counter(
            "meshws_generations", "Generations finished on the head, by outcome", ["outcome"], registry=self.registry
        )
        self.generated_tokens = Counter("meshws_generated_tokens", "Tokens generated on the head",
                                        registry=self.registry)
        self.laps = Counter("meshws_decode_laps", "Decode laps through the mesh (each yields 1 token + drafts kept)",
                            registry=self.registry)
        self.lap_seconds = Counter("meshws_lap_seconds", "Time of the head's laps by part: its own layers "
                                   "(head), each shard on the route in order (hop1, hop2, ...; as they report it), "
                                   "and what is left: the links (network; and link1, link2, ...: each link, split by "
                                   "what the hops say they waited for the rest)", ["part"], registry=self.registry)
        self.draft_tokens = Counter("meshws_draft_tokens", "Guessed tokens sent for verification, by what the tail "
                                    "did with them", ["result"], registry=self.registry)

    def watch_admission(self, running: Callable[[], int], queued: Callable[[], int]) -> None:
        """A head's admission: generations holding a slot, requests queued, their waits and refusals."""
        running_gauge = Gauge("meshws_generations_running", "Generations holding a slot on the head (releases "
                              "included)", registry=self.registry)
        running_gauge.set_function(lambda: float(running()))
        queued_gauge = Gauge("meshws_queue_depth", "Requests waiting for a generation slot", registry=self.registry)
        queued_gauge.set_function(lambda: float(queued()))
        self.queue_wait_seconds = Histogram("meshws_queue_wait_seconds", "Time an admitted request waited for "
                                            "its slot", buckets=QUEUE_BUCKETS, registry=self.registry)
        self.admission_refused = Counter("meshws_admission_refused", "Requests refused by admission, by reason",
                                         ["reason"], registry=self.registry)
        # Per request, as vLLM names them (vllm:time_to_first_token_seconds, ...): from the request's arrival.
        self.first_token_seconds = Histogram("meshws_time_to_first_token_seconds", "From a request's arrival "
                                             "(queue included) to its first token", buckets=LATENCY_BUCKETS,
                                             registry=self.registry)
        self.inter_token_seconds = Histogram("meshws_inter_token_latency_seconds", "Between a request's laps "
                                             "that brought tokens (one lap may bring several)",
                                             buckets=GAP_BUCKETS, registry=self.registry)
        self.request_seconds = Histogram("meshws_e2e_request_latency_seconds", "From a request's arrival to its "
                                         "answer's end", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("meshws_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.failovers = Counter("meshws_failovers", "Routes a head's answers lost a hop on, by how each went on: "
                                 "standby (its copy of the KV) or prefill (everything again)", ["resumed"],
                                 registry=self.registry)
        self.failover_tokens = Counter("meshws_failover_recomputed_tokens", "Positions failovers ran again",
                                       registry=self.registry)

    def watch_reuse(self, reuse: Callable[[], dict[str, int]], evictions: Callable[[], dict[str, int]]) -> None:
        """A head's kept sessions: answers that resumed one (hit: cached positions reused), tokens reused, evictions."""
        registry = self.registry

        class Reuse:
            def collect(self):  # type: ignore[no-untyped-def]
                counts = reuse()
                answers = CounterMetricFamily("meshws_session_reuse", "Answers that resumed a kept session "
                                              "(/ws/chat or the warm pool): hit reused cached positions",
                                              labels=["result"])
                answers.add_metric(["hit"], counts["hits"])
                answers.add_metric(["miss"], counts["misses"])
                yield answers
                yield CounterMetricFamily("meshws_reused_prompt_tokens", "Prompt tokens not prefilled again because "
                                          "a kept session's caches held them", value=counts["reused_tokens"])
                gone = CounterMetricFamily("meshws_warm_evictions", "Warm sessions closed by the pool, by reason",
                                           labels=["reason"])
                for reason, count in evictions().items():
                    gone.add_metric([reason], count)
                yield gone

        registry.register(Reuse())

    def watch_compute(self, queued: Callable[[], int], busy_seconds: Callable[[], float] = lambda: 0.0,
                      share: BusyShare | None = None) -> None:
        """The compute worker: jobs waiting for it (prefill chunks, decode steps, releases), time computing, and
        its recent busy `share` (kept as `busy`: hop reports carry it)."""
        gauge = Gauge("meshws_compute_queued", "Jobs waiting for the compute worker", registry=self.registry)
        gauge.set_function(lambda: float(queued()))
        busy = Gauge("meshws_compute_busy_seconds", "Seconds the compute worker has spent computing since start "
                     "(its rate is the busy fraction; 1 - rate is the time idle or waiting on the network)",
                     registry=self.registry)
        busy.set_function(lambda: float(busy_seconds()))
        self.busy = share
        if share is not None:
            Gauge("meshws_compute_busy_share", f"Share of the last {BUSY_WINDOW:g} s the compute worker spent "
                  "computing", registry=self.registry).set_function(share.now)

    def frame(self, direction: str, kind: str, size: int) -> None:
        self.frames.labels(direction, kind).inc()
        self.frame_bytes.labels(direction, kind).inc(size)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WeightCollector:
    """The shard's weight facts, read when /metrics is scraped (the resident bytes change as pages are read)."""

    def __init__(self, weights: Callable[[], dict[str, Any]]) -> None:
        self.weights = weights

    def collect(self) -> Iterator[GaugeMetricFamily]:
        facts = self.weights()
        yield GaugeMetricFamily("meshws_weight_mapped_bytes", "Bytes of the GGUF's tensors this node maps as its "
                                "weights", value=float(facts.get("mapped_bytes", 0)))
        yield GaugeMetricFamily("meshws_weight_resident_bytes", "Bytes of this node's weights resident in memory now",
                                value=float(facts.get("resident_bytes", 0)))
        types = GaugeMetricFamily("meshws_weight_type_bytes", "Bytes of this node's weights by block type",
                                  labels=["type"])
        for kind, size in facts.get("block_types", {}).items():
            types.add_metric([kind], float(size))
        yield types
