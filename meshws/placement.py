"""A node's side of placement: what it measures and tells its head, and how it follows the head's plan.

`NodeCapacity` is what a node brings (`head.placement.Capacity`): its speed, measured in seconds per mean layer
per token (`model.speed`) on every lone decode step the compute worker runs and, when it ran nothing for
`PROBE_EVERY` seconds (`idle_seconds`), by a probe of a few steps of its own (ever less often while its speed holds,
once settled in the plan: `IdleProbes`); its memory budget (`--memory`, else the memory free at start less a tenth);
and its heartbeat's round trip to the head. Joins carry it and `/health` shows it.

`PlanFollower` is an automatic middle or tail (`--layers auto`): the answer to each heartbeat names the span the
head's plan gives it; it loads that span beside the one it serves (`ModelShard.prepare_span`, off the event
loop), says so, and takes it when the head says `commit` (`ShardService.move`: every session ends as lost, then
the layers change). Outside the plan it keeps one layer, to be measured on. `head_placement` wires the head's
side (`head.rebalance.Placement`); the head moves its own layers the same way when it runs `--layers auto`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Sequence

from . import heap
from .head.placement import RESERVE_TOKENS, UNMEASURED, Capacity, span_fits
from .head.rebalance import DRIFT, HeadSide, Placement
from .model.costs import ModelCosts
from .model.memory import available_memory
from .model.speed import STEADY_STEPS, SpeedMeter, probe

log = logging.getLogger("meshws.placement")

MAX_VERSION = 2**53  # plan versions a head may name (as the head checks a node's report of them)
PROBE_EVERY = 3.0  # seconds a node ran nothing (`idle_seconds`) before its next probe, at the shortest (`IdleProbes`)
PROBE_MOST = 48.0  # seconds between an idle node's probes at most, while they find its speed the same
PROBE_SETTLE = 120.0  # seconds after its start (or while the plan leaves it out) that a node probes every PROBE_EVERY
MEMORY_MARGIN = 0.1  # of the memory free at start, left out of the default budget
ROLES = {"auto": ("middle", "tail"), "middle": ("middle",), "tail": ("tail",), "head": ("head",)}


class IdleProbes:
    """When an idle node probes: PROBE_EVERY seconds after its last step or probe, then twice as long after each probe
    that found its speed within DRIFT of what it was (PROBE_MOST at most), and PROBE_EVERY again once a probe finds it
    changed, a step runs, or the node is not `steady` (in its first PROBE_SETTLE seconds, when loading beside others
    may have slowed its first probes, or left out of the plan: a spare is weighed for a place from its latest probes).
    An idle placed machine whose speed holds spends a probe a minute on it, not one every few seconds (an idle 1B full
    node spent 8 % of a core on them), and one that slows down or speeds up is measured again soon."""

    def __init__(self) -> None:
        self.wait = PROBE_EVERY

    def due(self, idle_for: float, source: str, steady: bool = True) -> bool:
        """Whether to probe now, `idle_for` seconds after the meter's last sample, which came from `source`."""
        if source != "probe" or not steady:  # steps ran since the last probe, or the node must be weighed often
            self.wait = PROBE_EVERY
        return idle_for >= self.wait

    def probed(self, before: float | None, after: float | None) -> None:
        """A probe moved the meter's speed from `before` to `after` (seconds per layer; None: not measured)."""
        held = before is not None and after is not None and before > 0 and abs(after / before - 1) <= DRIFT
        self.wait = min(PROBE_MOST, self.wait * 2) if held else PROBE_EVERY


def idle_seconds(meter: SpeedMeter, jobs: Sequence[tuple[float, float, int]], now: float | None = None) -> float:
    """How long a node has been idle: since its last lone step timed (or probe) and its compute worker's last job
    (`jobs`: (start, end, rows), monotonic). A node busy with batches is not idle: it keeps what it measured last.
    Probes between a batch's steps, its event loop serving many streams on the same cores, read up to 1.6x apart, and
    a head that re-planned on them moved its layers every half minute under a steady load of 16 sessions."""
    last_job = jobs[-1][1] if jobs else float("-inf")
    return min(meter.idle_for(), (time.monotonic() if now is None else now) - last_job)


class NodeCapacity:
    def __init__(self, node: Any) -> None:  # (a `meshws.node.Node`, as every `node` here)
        self.node = node
        self.started = time.monotonic()
        self.meter = SpeedMeter()  # the layers': seconds per mean layer
        self.lm_head = SpeedMeter()  # a tail's LM head: seconds per step
        free = available_memory()
        self.memory = node.settings.memory or (int(free * (1 - MEMORY_MARGIN)) if free else None)
        self._round_trips: deque[float] = deque(maxlen=8)

    def step_timed(self, seconds: float, lm_head: float = 0.0, source: str = "steps") -> None:
        """A lone decode step through the node's span took `seconds`, `lm_head` of them in the LM head (the compute
        worker's report, or a probe's: the mean of its steps, weighing as STEADY_STEPS)."""
        shard = self.node.shard
        if shard.costs is None:
            return
        weight = STEADY_STEPS if source == "probe" else 1.0
        self.meter.record(seconds - lm_head, shard.costs.units(shard.start, shard.end), source, weight)
        if shard.is_tail and lm_head > 0:
            self.lm_head.record(lm_head, 1.0, source, weight)

    def round_trip(self, seconds: float) -> None:
        self._round_trips.append(seconds)

    @property
    def link_seconds(self) -> float:
        return min(self._round_trips, default=0.0)

    async def probe(self) -> None:
        shard = self.node.shard
        if shard.costs is None:
            return
        self.step_timed(*await self.node.worker.call(probe, shard), source="probe")

    async def probe_ctx(self, app: object) -> AsyncIterator[None]:
        """(An aiohttp cleanup context.) A probe before the node joins or plans; then, on a node that takes part in
        placement, others while it runs no lone step (`IdleProbes`)."""
        await self.probe()
        task = asyncio.create_task(self._probe_forever()) if self.node.settings.join or self.node.registry else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _probe_forever(self) -> None:
        probes = IdleProbes()
        while True:
            await asyncio.sleep(PROBE_EVERY / 2)
            follower = self.node.follower
            steady = time.monotonic() - self.started >= PROBE_SETTLE and (follower is None or follower.placed)
            if probes.due(idle_seconds(self.meter, self.node.worker.recent), self.meter.source, steady):
                before = self.meter.layer_seconds
                try:
                    await self.probe()
                except Exception as exc:  # (a node stopping, or one whose shard cannot step: no speed news)
                    log.debug("probe failed: %s", exc)
                    continue
                probes.probed(before, self.meter.layer_seconds)

    def measured(self) -> dict[str, Any]:
        """What a join carries (`head.membership` checks it)."""
        layer = self.meter.layer_seconds
        measured: dict[str, Any] = {"layer_ms": (layer if layer else UNMEASURED) * 1000,
                                    "link_ms": self.link_seconds * 1000}
        if self.memory:
            measured["memory"] = self.memory
        lm_head = self.lm_head.layer_seconds
        if lm_head and self.node.shard.is_tail:
            measured["lm_head_ms"] = lm_head * 1000
        if self.node.metrics.busy is not None:
            measured["busy"] = self.node.metrics.busy.now()  # (the page shows each stage's)
        return measured

    def describe(self) -> dict[str, Any]:
        """/health's `capacity`."""
        lm_head = self.lm_head.layer_seconds if self.node.shard.is_tail else None
        return {**self.meter.describe(), "lm_head_ms": round(lm_head * 1000, 4) if lm_head else None,
                "memory": self.memory, "link_ms": round(self.link_seconds * 1000, 3)}

    def capacity(self, auto: bool) -> Capacity:
        """The head's own, as its planner sees it."""
        return Capacity("head", self.meter.layer_seconds or UNMEASURED, self.memory or 0, 0.0,
                        None if auto else self.node.span, frozenset({"head"}))


class PlanFollower:
    """An automatic node: the span of its head's plan, loaded beside the one it serves, taken on `commit`."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.roles = ROLES[node.settings.role]
        self.epoch = ""  # whose plan versions these are (the head's)
        self.serving = 0  # the plan version this node serves
        self.placed = False  # the head's plan gives this node a span (else: one layer, to be measured on)
        self._prepared: tuple[int, tuple[int, int], Any] | None = None  # (version, span, the span's parts)
        self._loading: tuple[int, int] | None = None
        self._committing = False
        self._tasks: set[asyncio.Task] = set()

    @property
    def moving(self) -> bool:
        """A span is loading or waits to be taken: the heartbeat hurries."""
        return self._loading is not None or self._prepared is not None

    def report(self) -> dict[str, Any]:
        prepared = self._prepared[0] if self._prepared is not None else 0
        return {"auto": True, "roles": list(self.roles),
                "plan": {"epoch": self.epoch, "serving": self.serving, "prepared": prepared}}

    def heard(self, answer: Any) -> None:
        """The first head's answer to a heartbeat (checked as any input from the network)."""
        instruction = _instruction(answer, self.node.shard.total_layers, self.roles)
        if instruction is None:
            return
        epoch, version, span, commit = instruction
        self.placed = answer["plan"].get("placed") is not False
        if epoch != self.epoch:  # another head's count (it restarted): what this node serves is news to it
            self.epoch, self.serving, self._prepared = epoch, 0, None
        memory = self.node.capacity.memory
        if memory and span != self.node.span and not span_fits(self.node.shard.costs, memory, *span):
            log.warning("ignored a plan whose layers %d-%d do not fit this node's budget (%d MiB)", span[0],
                        span[1] - 1, memory // 2**20)
            return
        if span == self.node.span:
            self._prepared = self._loading = None  # (a load under way for another span is dropped when it ends)
            self.serving = max(self.serving, version)
        elif self._prepared is not None and self._prepared[1] == span:
            self._prepared = (version, span, self._prepared[2])
            if commit and not self._committing:
                self._committing = True  # (before the task runs: the next answer must not start another)
                self._spawn(self._commit())
        elif self._loading != span:
            self._spawn(self._prepare(version, span))

    async def _prepare(self, version: int, span: tuple[int, int]) -> None:
        self._loading, self._prepared = span, None
        try:
            parts = await asyncio.to_thread(self.node.shard.prepare_span, *span)
        except Exception:
            log.exception("could not load layers %d-%d", span[0], span[1] - 1)
            self._loading = None if self._loading == span else self._loading
            return
        if self._loading != span:
            return  # another span was asked for meanwhile
        self._loading, self._prepared = None, (version, span, parts)
        log.info("loaded layers %d-%d beside %d-%d for plan %d", span[0], span[1] - 1, self.node.span[0],
                 self.node.span[1] - 1, version)
        await self._tell()

    async def _commit(self) -> None:
        assert self._prepared is not None and self.node.shard_service is not None
        version, span, parts = self._prepared
        node = self.node
        try:
            ended = await node.shard_service.move(lambda: node.worker.call(node.shard.adopt, parts))
        finally:
            self._committing = False
        self._prepared = None
        node.role = "tail" if node.shard.is_tail else "middle"
        heap.refreeze()
        self.serving = version
        log.info("serving layers %d-%d for plan %d as a %s (%d sessions ended)", span[0], span[1] - 1, version,
                 node.role, ended)
        await self._tell()

    async def _tell(self) -> None:
        if self.node.announcer is not None:
            await self.node.announcer.announce_now()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _instruction(answer: Any, total: int,
                 roles: tuple[str, ...]) -> tuple[str, int, tuple[int, int], bool] | None:
    """(epoch, version, span, commit) from a heartbeat's answer, or None where it has none or it does not fit."""
    plan = answer.get("plan") if isinstance(answer, dict) else None
    if not isinstance(plan, dict):
        return None
    version, layers, commit, epoch = plan.get("version"), plan.get("layers"), plan.get("commit"), plan.get("epoch")
    if not (isinstance(version, int) and not isinstance(version, bool) and 0 < version <= MAX_VERSION
            and isinstance(commit, bool) and isinstance(epoch, str) and len(epoch) <= 64
            and isinstance(layers, list) and len(layers) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in layers)
            and 0 < layers[0] < layers[1] <= total):
        log.warning("ignored a plan the head sent that does not fit this model: %.200s", plan)
        return None
    span = (layers[0], layers[1])
    if plan.get("placed") is not False and ("tail" if span[1] == total else "middle") not in roles:
        log.warning("ignored a plan that makes this node a role it may not take: %s", plan)
        return None
    return epoch, version, span, commit


def head_placement(node: Any, capacity: NodeCapacity) -> Placement:
    """The head's placement, wired to this head node: its own span, capacity and generations."""
    shard, auto = node.shard, node.settings.layers == "auto"
    prepared: dict[tuple[int, int], Any] = {}  # by span (a load for a move given up may end during a later one)

    async def prepare(span: tuple[int, int]) -> None:
        parts = await asyncio.to_thread(shard.prepare_span, *span)
        prepared.clear()
        prepared[span] = parts

    async def commit(span: tuple[int, int]) -> None:
        await node.worker.call(shard.adopt, prepared.pop(span))  # (KeyError: not loaded; the move is given up)
        heap.refreeze()

    assert node.head is not None and node.registry is not None
    head = node.head
    side = HeadSide(lambda: capacity.capacity(auto), lambda: node.span, prepare, commit, head.running_sessions,
                    head.end_idle_conversations)
    return Placement(node.registry, shard.costs, side, auto, node.settings.replan_seconds)


def budget_problem(costs: ModelCosts, memory: int, span: tuple[int, int] | None, roles: tuple[str, ...]) -> str:
    """Why `--memory` cannot work for this node ("" when it can): a hand-placed span it cannot hold, or no span at
    all an automatic node could serve."""
    reserve = RESERVE_TOKENS * costs.kv_bytes_per_token
    total = costs.total_layers

    def need(start: int, end: int) -> int:
        return costs.weight_bytes(start, end) + reserve * (end - start)

    if span is not None:
        if need(*span) <= memory:
            return ""
        return (f"--memory {_mib(memory)} cannot hold layers {span[0]}-{span[1] - 1}: with room for {RESERVE_TOKENS} "
                f"tokens of KV they need {_mib(need(*span))}")
    smallest = {"head": need(0, 1), "tail": need(total - 1, total),
                "middle": min((need(i, i + 1) for i in range(1, total - 1)), default=need(total - 1, total))}
    least = min(smallest[role] for role in roles)
    if least <= memory:
        return ""
    return (f"--memory {_mib(memory)} holds no span of this model: the smallest a {' or '.join(roles)} could serve "
            f"needs {_mib(least)} (one layer{', the embeddings' if roles == ('head',) else ''}"
            f"{', the LM head' if roles == ('tail',) else ''} and room for {RESERVE_TOKENS} tokens of KV)")


def _mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"
