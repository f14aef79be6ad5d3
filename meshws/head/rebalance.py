"""The plan in force on a head that places layers, and moving to a better one live.

A head places layers when it runs `--layers auto` itself or a joined node does. Every `TICK` it asks whether to
re-plan: a node joined, left or began draining, a budget changed, a node's measured speed has stayed more than
`DRIFT` off the plan's for `replan_seconds`, or (each `replan_seconds`) the plan leaves nodes out: a spare measured
slow once may replicate the chain in force now. A new plan (`placement.plan`) replaces the one in force if none, if
that one is broken (a node left, or may no longer hold its span), if it only adds replicas, or if it is `MIN_GAIN`
faster, or its slowest stage `MIN_GAIN` lighter within `BALANCE_SLACK` of one session's time (many sessions' pace;
not on a spare's account alone). Versions count within this head's `epoch`.

A move goes in two halves, so no answer ever meets layers that are not the ones its route expects:

1. *Preparing*: every automatic node whose span changes loads the new one beside the one it serves (the
   heartbeat's answer says which: `instruction`), and says so in its next heartbeat; the head loads its own.
2. *Switching*, once all are ready: if any node of the plan in force changes span, running answers park at their
   next step (each leaves its route, so every hop drops its caches; `parked`), kept conversations close, and new
   requests wait; an answer that does not reach the end of its step within `PARK_TIMEOUT` defers the move. Then
   every node takes its new span at once (the heartbeat's answer says `commit`), and the head its own once all
   report theirs; the new plan is in force, and parked answers open routes on it and prefill again (prompt and
   tokens so far), as after a failover. Nodes left out drop to a one-layer span (memory released, speed measured).
A move given up (a node too slow to load, or gone, an answer that did not park) is tried again after `COOLDOWN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from ..mesh.aio import until
from ..model.costs import ModelCosts
from .balance import BALANCE_SLACK
from .placement import Capacity, Plan, capacity, chain_seconds, holds, plan, probe_span
from .registry import Registry
from .routes import NodeRecord

log = logging.getLogger("meshws.placement")

TICK = 0.25  # seconds between checks
DRIFT = 0.25  # a node whose speed is off the plan's by more than this share for `replan_seconds` is re-planned for
MIN_GAIN = 0.10  # a plan this much faster than the one in force (at today's speeds) is worth a move
PREPARE_TIMEOUT = 120.0  # seconds the nodes may take to load their new spans
PARK_TIMEOUT = 10.0  # seconds running answers may take to reach the end of their step and park
COMMIT_TIMEOUT = 15.0  # seconds the nodes may take to report their new spans
SETTLE_WAIT = 60.0  # the most a request or a parked answer waits for a move to end
COOLDOWN = 20.0  # after an abandoned move, before speed alone re-plans
SPARE = "left out: "  # a re-plan's reason that weighs a spare again: it may add replicas, not move layers
SETTLE = 8.0  # after a move, before speed alone re-plans (the moved nodes' speeds measured on their new spans)


@dataclass
class HeadSide:
    """What the placement needs of the head it runs on."""

    capacity: Callable[[], Capacity]  # the head's own (span None when it places itself too)
    span: Callable[[], tuple[int, int]]
    prepare: Callable[[tuple[int, int]], Awaitable[None]]  # load this span beside the one served
    commit: Callable[[tuple[int, int]], Awaitable[None]]  # serve the span prepared (KeyError: none loaded)
    running: Callable[[], set[str]]  # the generations running now
    end_kept: Callable[[], Awaitable[None]]  # close the conversations kept between answers


class Placement:
    def __init__(self, registry: Registry, costs: ModelCosts, head: HeadSide, head_auto: bool,
                 replan_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.costs = costs
        self.head = head
        self.head_auto = head_auto
        self.replan_seconds = replan_seconds
        self._clock = clock
        self.version = 0
        self.epoch = secrets.token_hex(8)  # this head's count of versions: a node's report of another's is no news
        self.live: Plan | None = None  # the plan in force
        self.target: Plan | None = None  # the plan being moved to
        self.phase = "idle"  # idle (no plan yet), live, preparing, switching
        self.committing = False  # the nodes are told to take the target's spans
        self.settled = asyncio.Event()
        self.settled.set()
        self.parked: set[str] = set()  # generations waiting for the move to end
        self.moves = self.abandoned = 0
        self.last_reason = ""
        self._head_prepared = 0  # the version the head has loaded its span for
        self._started = 0.0  # when the move under way began
        self._quiet_until = 0.0  # speed alone does not re-plan before this
        self._signature: tuple | None = None  # the members and budgets the plan in force was made with
        self._target_signature: tuple | None = None  # ... and the plan being moved to
        self._target_speeds: dict[str, float] = {}
        self._basis: dict[str, float] = {}  # each node's speed the plan in force is measured against
        self._drift_since: dict[str, float] = {}
        self._spares_weighed = 0.0  # when the nodes the plan leaves out were last weighed again

    # -- what the rest of the head asks --------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the head places layers: it or a joined node runs --layers auto."""
        return self.head_auto or any(record.auto for record in self.registry.nodes())

    @property
    def switching(self) -> bool:
        return self.phase == "switching" and not self.settled.is_set()

    def routable(self, record: NodeRecord) -> bool:
        """A node may carry new sessions: it is in the plan in force, on the span planned for it."""
        span = self.live.span_of(record.url) if self.live is not None else None
        return span is not None and span.layers == record.layers

    def instruction(self, url: str) -> dict[str, Any] | None:
        """What a heartbeat's answer tells an automatic node: the span of the plan it should serve, and whether to
        take it now."""
        plan_ = self.target or self.live
        if plan_ is None or not plan_.spans:
            return None  # (no plan, or one that cannot serve: every node keeps what it holds)
        span = plan_.span_of(url)
        return {"version": plan_.version, "epoch": self.epoch,
                "layers": list(span.layers if span is not None else probe_span(self.costs.total_layers)),
                "role": span.role if span is not None else "middle", "placed": span is not None,
                "commit": self.target is None or self.committing}

    def expected(self, url: str) -> tuple[int, int] | None:
        """The span a node is moving to (its hello may say it before its heartbeat does)."""
        span = self.target.span_of(url) if self.target is not None else None
        return span.layers if span is not None else None

    async def wait_settled(self) -> None:
        """Until no move is switching (at most SETTLE_WAIT)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SETTLE_WAIT):
                await self.settled.wait()

    @contextlib.contextmanager
    def waiting(self, sid: str) -> Any:
        """A generation waits for the plan (parked, or re-routing while a move goes on): a switch need not wait
        for it."""
        self.parked.add(sid)
        try:
            yield
        finally:
            self.parked.discard(sid)

    def describe(self) -> dict[str, Any]:
        """/health's `plan`: the plan in force (or the one being moved to), its state and why it was made. A mesh
        placed by hand shows the chain the planner would choose among its nodes (version 0), with their speeds."""
        records = [record for record in self.registry.nodes() if not record.static]
        shown = (self.live or self.target or Plan(0, missing="no plan yet")) if self.active else \
            plan(self.head.capacity(), [capacity(record) for record in records if not record.draining], self.costs,
                 0, lm_factor=self._lm_factor(records))
        view = {**shown.describe(), "state": self.phase, "automatic": self.active, "moves": self.moves,
                "reason": self.last_reason, "lm_head_factor": round(self._lm_factor(records), 3)}
        if self.target is not None:
            view["moving_to"] = self.target.describe()
        return view

    # -- the loop ------------------------------------------------------------------------------------

    async def run_ctx(self, app: object) -> AsyncIterator[None]:
        """An aiohttp cleanup context: the placement loop while the node runs."""
        task = asyncio.create_task(self._forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.settled.set()

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.tick()
            except Exception:  # the placement goes on whatever one tick raised
                log.exception("placement tick failed")

    async def tick(self) -> None:
        if not self.active:
            return
        now = self._clock()
        records = [record for record in self.registry.nodes() if not record.static]
        if self.phase == "preparing":
            await self._follow_move(records, now)
            return
        reason = self._reason(records, now)
        if not reason:
            return
        spares_only = reason.startswith(SPARE)  # (the chain stays: a spare faster than its primary replicates it)
        candidate = await asyncio.to_thread(  # (pure, and off the event loop: a large mesh takes a moment)
            plan, self.head.capacity(), [capacity(r) for r in records if not r.draining], self.costs,
            self.version + 1, lm_factor=self._lm_factor(records), keep=self.live if spares_only else None)
        self.last_reason = reason
        if not self._worth(candidate, records, spares_only):
            if not spares_only:  # (after weighing spares, drift is still measured from the plan's speeds)
                self._rebase(records)
            return
        self.version = candidate.version
        self.target, self.phase, self._started = candidate, "preparing", now
        self._target_signature = _signature(records)  # (a node that joins meanwhile is planned for after)
        self._target_speeds = self._speeds(records)  # what drift is measured from once it is in force
        log.info("plan %d (%s): %s", candidate.version, reason, candidate.summary())
        head = candidate.span_of("head")
        if self.head_auto and head is not None and head.layers != self.head.span():
            asyncio.get_running_loop().create_task(self._prepare_head(candidate.version, head.layers))
        else:
            self._head_prepared = candidate.version

    def _reason(self, records: list[NodeRecord], now: float) -> str:
        """Why to plan again now ("" for no reason)."""
        if self._signature != _signature(records):
            return "nodes joined, left or changed their budgets" if self.live is not None else "first plan"
        if self.live is None and now >= self._quiet_until:
            return "no plan in force yet: trying again"
        if self.replan_seconds <= 0 or now < self._quiet_until or self.live is None or not self.live.spans:
            return ""  # (speed moves nothing while no plan serves: only members and budgets do)
        speeds = self._speeds(records)
        for node, basis in self._basis.items():
            speed = speeds.get(node)
            if speed is None or abs(speed / basis - 1) <= DRIFT:
                self._drift_since.pop(node, None)
                continue
            since = self._drift_since.setdefault(node, now)
            if now - since >= self.replan_seconds:
                return f"{node} runs at {speed * 1000:.3g} ms per layer, {basis * 1000:.3g} when planned"
        if self.live.left_out and now - self._spares_weighed >= self.replan_seconds:
            self._spares_weighed = now
            return f"{SPARE}{', '.join(self.live.left_out)}"
        return ""

    def _worth(self, candidate: Plan, records: list[NodeRecord], spares_only: bool = False) -> bool:
        """Whether to move to `candidate`: no plan in force, or it lost a node, or the candidate is faster enough
        (not when only spares were weighed again), or it only adds replicas to the same chain."""
        live = self.live
        if live is None or not live.spans:
            return True
        present = {record.url: record for record in records if not record.draining}
        if self._broken(live, present):
            return True  # a member left or drains, or may no longer hold its span (a budget or a role changed)
        if not candidate.spans:
            return False
        speeds = {url: capacity(record) for url, record in present.items()}
        speeds["head"] = self.head.capacity()
        now_seconds, now_slowest = chain_seconds(live, speeds, self.costs, self._lm_factor(records))
        same_chain = [(s.node, s.layers) for s in live.chain] == [(s.node, s.layers) for s in candidate.chain]
        if same_chain:
            return [(s.node, s.layers) for s in candidate.spans] != [(s.node, s.layers) for s in live.spans]
        slowest = max(span.seconds for span in candidate.chain)  # (many sessions: a lighter slowest stage is as good)
        seconds = candidate.seconds_per_token
        return not spares_only and (seconds < now_seconds * (1 - MIN_GAIN) or (
            slowest < now_slowest * (1 - MIN_GAIN) and seconds <= now_seconds * (1 + BALANCE_SLACK)))

    def _broken(self, live: Plan, present: dict[str, NodeRecord]) -> bool:
        """A span of the plan in force whose node is gone, drains, was placed by hand elsewhere, or may no longer
        hold it: its budget shrank or its roles changed."""
        return any(span.node != "head" and (span.node not in present or not holds(
            self.costs, capacity(present[span.node]), span)) for span in live.spans)

    def _rebase(self, records: list[NodeRecord]) -> None:
        """The plan in force stays: today's members, budgets and speeds become what drift is measured from."""
        self._signature = _signature(records)
        self._basis = self._speeds(records)
        self._drift_since.clear()

    def _lm_factor(self, records: list[NodeRecord]) -> float:
        """How much slower (or faster) per byte tails measure their LM head than their layers: the median."""
        ratios = [record.lm_head_seconds / (record.layer_seconds * self.costs.lm_head_units) for record in records
                  if record.lm_head_seconds and record.layer_seconds and self.costs.lm_head_units > 0]
        return min(10.0, max(0.1, statistics.median(ratios))) if ratios else 1.0

    def _speeds(self, records: list[NodeRecord]) -> dict[str, float]:
        speeds = {record.url: record.layer_seconds for record in records if record.layer_seconds}
        return {**speeds, "head": self.head.capacity().layer_seconds}

    async def _prepare_head(self, version: int, span: tuple[int, int]) -> None:
        try:
            await self.head.prepare(span)
            self._head_prepared = version
        except Exception:
            log.exception("the head could not load layers %d-%d", span[0], span[1] - 1)

    def _abandon(self, why: str, again_at_once: bool, records: list[NodeRecord]) -> None:
        """The move under way is given up: the plan in force stays (the nodes are told its spans again), and a new
        plan is made at once (`again_at_once`: a node left) or after COOLDOWN."""
        target = self.target
        log.warning("plan %d abandoned: %s", target.version if target else 0, why)
        self.target, self.phase, self.committing = None, "live" if self.live is not None else "idle", False
        self.abandoned += 1
        self._signature = None if again_at_once else _signature(records)
        self._quiet_until = self._clock() + COOLDOWN
        self.settled.set()

    async def _follow_move(self, records: list[NodeRecord], now: float) -> None:
        target = self.target
        assert target is not None
        present = {record.url: record for record in records if not record.draining}
        automatic = [record for record in present.values() if record.auto and target.spans]  # (told to move)
        gone = [span.node for span in target.spans if span.node != "head" and span.node not in present]
        ready = self._head_prepared >= target.version and all(
            record.epoch == self.epoch and (record.prepared >= target.version or record.serving >= target.version)
            for record in automatic)
        if gone or now - self._started > PREPARE_TIMEOUT:
            self._abandon(f"{', '.join(gone)} left" if gone else
                          f"not every node loaded its span within {PREPARE_TIMEOUT:g} s", bool(gone), records)
            return
        if ready:
            try:
                await self._switch(target, present)
            except Exception as exc:  # (the head's own move failed): the plan in force stays, nobody waits on
                log.exception("the move to plan %d failed", target.version)
                self._abandon(f"{type(exc).__name__}: {exc}", False, records)

    async def _switch(self, target: Plan, present: dict[str, NodeRecord]) -> None:
        """Park what runs on spans that change, tell every node to take its new span, and wait until they have."""
        self.phase = "switching"
        head = target.span_of("head")
        head_moves = head is not None and self.head_auto and head.layers != self.head.span()
        live = self.live
        changes = head_moves or (live is not None and any(
            (target.span_of(span.node) or span).layers != span.layers or target.span_of(span.node) is None
            for span in live.spans))
        if changes:
            self.settled.clear()
            await self.head.end_kept()
            if not await until(lambda: self.head.running() <= self.parked, PARK_TIMEOUT):
                # An answer still in a long step: moving now could hand its next step to layers its route did not
                # name. The plan in force stays; the move is tried again later.
                self._abandon(f"{len(self.head.running() - self.parked)} answer(s) did not reach the end of their "
                              f"step within {PARK_TIMEOUT:g} s", False, list(present.values()))
                return
        self.committing = True  # the nodes first: a step still under way meets a node that answers "lost"
        wanted = {url: (target.span_of(url).layers if target.span_of(url) is not None
                        else probe_span(self.costs.total_layers))
                  for url, record in present.items() if record.auto and target.spans}
        await until(lambda: all(self._reports(url, layers, target.version) for url, layers in wanted.items()),
                     COMMIT_TIMEOUT)
        if head_moves:
            assert head is not None
            await self.head.commit(head.layers)
        self.live, self.target, self.phase, self.committing = target, None, "live", False
        self.moves += 1
        self._signature, self._basis = self._target_signature, self._target_speeds  # (what it was planned with)
        self._drift_since.clear()
        self._quiet_until = self._clock() + SETTLE
        self.settled.set()
        log.info("plan %d in force: %s", target.version, target.summary())

    def _reports(self, url: str, layers: tuple[int, int], version: int) -> bool:
        record = next((r for r in self.registry.nodes() if r.url == url), None)
        return record is None or (record.layers == layers and record.epoch == self.epoch and record.serving >= version)


def _signature(records: list[NodeRecord]) -> tuple:
    return tuple(sorted((r.url, r.auto, None if r.auto else r.layers, r.memory, r.draining, r.roles)
                        for r in records))
