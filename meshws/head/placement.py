"""Placement: which node serves which layers, from each node's measured speed and memory. A pure function.

`plan(head, nodes, costs)` chooses a chain `head [0, a) -> middles -> tail [z, L)` that minimises one session's
time per token: the sum over the chain of each node's seconds per mean layer times its span's work
(`ModelCosts.units`; the tail's LM head in mean layers too, times `lm_factor`: how much slower or faster per byte
tails measure it than their layers) plus each hop's link time, under every node's memory budget
(the weights it maps, the embeddings on the head and the LM head on the tail, plus `RESERVE_TOKENS` of KV for
each of its layers). Nodes placed by hand keep their spans and are used where the chain reaches them; nodes
placed automatically may take any span their budget holds, in a role they allow. A node that would only slow
the chain is left out; a spare node that serves some span of the chain at most `REPLICA_SLOWDOWN` times as
slowly as its primary becomes that span's replica (sessions spread over both), else it is left out.

The search: for each choice of tail and each order of the automatic middles (every order while there are at
most `EXACT_ORDERS_UP_TO` of them, else fastest first), a dynamic programme over (layer reached, middles
considered), each middle taking a span or none. It is exact for three automatic middles or fewer; beyond, the
fastest-first order is exact when layers weigh alike (then a middle's place in the chain changes nothing).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..model.costs import ModelCosts

RESERVE_TOKENS = 2048  # KV positions each placed layer keeps room for (one session of 1,000-odd tokens: buffers grow
# half as much again as they hold)
HOP_SECONDS = 0.001  # what a hop costs beyond its link's round trip: frames, the event loops, a wake-up
REPLICA_SLOWDOWN = 1.25  # a spare may replicate a span it runs at most this much slower than the primary
EXACT_ORDERS_UP_TO = 3  # automatic middles whose every order is tried
MAX_CANDIDATES = 12  # automatic nodes considered (fastest first): a plan takes tens of ms, not seconds


@dataclass(frozen=True)
class Capacity:
    """What a node brings: its measured speed, its budget, its link, and whether its span is its own choice."""

    node: str  # its advertised URL, or "head"
    layer_seconds: float  # seconds per mean layer per token, measured
    memory: int  # bytes it may hold: weights and KV cache
    link_seconds: float = 0.0  # round trip to the head
    span: tuple[int, int] | None = None  # placed by hand (fixed), or None: the plan chooses
    roles: frozenset[str] = frozenset({"middle", "tail"})  # what an automatic node may become


@dataclass(frozen=True)
class PlanSpan:
    node: str
    role: str  # head, middle or tail
    layers: tuple[int, int]  # half-open, as on the wire
    seconds: float  # this node's time per token on the span, predicted
    replica: bool = False  # a second node for a span of the chain

    def describe(self) -> dict[str, Any]:
        view = {"node": self.node, "role": self.role, "layers": list(self.layers), "ms": round(self.seconds * 1000, 2)}
        return {**view, "replica": True} if self.replica else view


@dataclass(frozen=True)
class Plan:
    version: int
    spans: tuple[PlanSpan, ...] = ()  # the chain in order, head first, then replicas
    seconds_per_token: float = math.inf  # one session's predicted time per token on the chain
    left_out: tuple[str, ...] = ()  # nodes given no span (they would only slow the chain, or hold nothing)
    missing: str = ""  # why there is no chain (then `spans` is empty)

    @property
    def chain(self) -> tuple[PlanSpan, ...]:
        return tuple(span for span in self.spans if not span.replica)

    def span_of(self, node: str) -> PlanSpan | None:
        return next((span for span in self.spans if span.node == node), None)

    def describe(self) -> dict[str, Any]:
        view: dict[str, Any] = {"version": self.version, "spans": [span.describe() for span in self.spans]}
        if self.spans:
            view["ms_per_token"] = round(self.seconds_per_token * 1000, 2)
        if self.left_out:
            view["left_out"] = list(self.left_out)
        if self.missing:
            view["missing"] = self.missing
        return view


_Candidate = tuple[float, int, float, list[tuple[Capacity, int, int]]]  # (seconds, hops, slowest hop, [(node, a, b)])


def _better(candidate: _Candidate, known: _Candidate | None) -> bool:
    """Faster (to a nanosecond), then fewer hops, then a lighter slowest hop (a balanced chain serves more)."""
    if known is None:
        return True
    return (round(candidate[0], 9), candidate[1], candidate[2]) < (round(known[0], 9), known[1], known[2])


@dataclass
class _Search:
    """One planning run's inputs and the best chain found so far."""

    costs: ModelCosts
    reserve: int  # KV bytes each placed layer keeps room for
    lm_factor: float = 1.0  # the LM head's seconds per mean layer, over the layers' 
    best: "_Candidate | None" = None
    reached: int = 0  # the furthest layer any partial chain reached
    prefix: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = [0, *itertools.accumulate(self.costs.layer_bytes)]

    def fits(self, node: Capacity, start: int, end: int) -> bool:
        if node.span is not None:
            return True  # placed by hand: it holds what it holds
        costs = self.costs
        held = self.prefix[end] - self.prefix[start] + (costs.embedding_bytes if start == 0 else 0) + \
            (costs.lm_head_bytes if end == costs.total_layers else 0) + self.reserve * (end - start)
        return held <= node.memory

    def seconds(self, node: Capacity, start: int, end: int) -> float:
        lm_head = self.costs.lm_head_units * self.lm_factor if end == self.costs.total_layers else 0.0
        return node.layer_seconds * (self.costs.units(start, end) + lm_head)

    def hop(self, node: Capacity) -> float:
        return node.link_seconds + HOP_SECONDS


def plan(head: Capacity, nodes: Sequence[Capacity], costs: ModelCosts, version: int = 0,
         reserve_tokens: int = RESERVE_TOKENS, lm_factor: float = 1.0) -> Plan:
    """The fastest chain that fits every budget, with replicas and left-out nodes; `missing` says why none does."""
    total = costs.total_layers
    search = _Search(costs, reserve_tokens * costs.kv_bytes_per_token, lm_factor)
    fixed = [node for node in nodes if node.span is not None]
    automatic = sorted((node for node in nodes if node.span is None),
                       key=lambda node: (node.layer_seconds, node.node))[:MAX_CANDIDATES]
    heads = [(head.span[1], search.seconds(head, *head.span))] if head.span is not None else \
        [(end, search.seconds(head, 0, end)) for end in range(1, total) if search.fits(head, 0, end)]
    if not heads:
        return Plan(version, missing=f"the head's budget ({_mib(head.memory)}) holds no span: the embeddings and "
                                     f"layer 0 need {_mib(search.prefix[1] + costs.embedding_bytes + search.reserve)}")
    tails = [node for node in automatic if "tail" in node.roles] + [None]  # None: a fixed node (or none) ends it
    for tail in tails:
        middles = [node for node in automatic if node is not tail and "middle" in node.roles]
        orders = itertools.permutations(middles) if len(middles) <= EXACT_ORDERS_UP_TO else [middles]
        for order in orders:
            _chain(search, heads, list(order), fixed, tail)
    if search.best is None:
        return Plan(version, left_out=tuple(node.node for node in nodes), missing=_missing(search, nodes))
    seconds, _, _, chain = search.best
    spans = [PlanSpan(node.node, "head" if start == 0 else "tail" if end == total else "middle", (start, end),
                      search.seconds(node, start, end)) for node, start, end in [(head, *chain[0][1:])] + chain[1:]]
    used = {span.node for span in spans}
    replicas = _replicas(search, [node for node in nodes if node.node not in used], spans)
    used |= {span.node for span in replicas}
    return Plan(version, tuple(spans + replicas), seconds,
                tuple(node.node for node in nodes if node.node not in used))


def _chain(search: _Search, heads: list[tuple[int, float]], middles: list[Capacity], fixed: list[Capacity],
           tail: Capacity | None) -> None:
    """The best chain with the middles taken in this order (each a span or none) and `tail` last (or a fixed tail);
    kept in `search` if better than its best."""
    total, count = search.costs.total_layers, len(middles)
    best: list[dict[int, _Candidate]] = [{} for _ in range(count + 1)]  # [i][p]: at layer p, first i middles weighed
    for end, seconds in heads:
        best[0][end] = (seconds, 0, seconds, [(Capacity("head", 0.0, 0), 0, end)])

    def offer(i: int, position: int, candidate: _Candidate) -> None:
        if _better(candidate, best[i].get(position)):
            best[i][position] = candidate
            search.reached = max(search.reached, position)

    def extend(known: _Candidate, node: Capacity, start: int, end: int) -> _Candidate:
        seconds, hops, slowest, chain = known
        own = search.seconds(node, start, end)
        return seconds + own + search.hop(node), hops + 1, max(slowest, own), chain + [(node, start, end)]

    for i in range(count + 1):
        for position in range(total):  # in order: a hand-placed node's span adds a later position to this row
            known = best[i].get(position)
            if known is None:
                continue
            for node in fixed:  # a hand-placed node whose span starts here
                if node.span is not None and node.span[0] == position and (node.span[1] < total or tail is None):
                    offer(i, node.span[1], extend(known, node, *node.span))
            if i < count:
                node = middles[i]
                offer(i + 1, position, known)  # this middle takes nothing
                for end in range(position + 1, total):
                    if not search.fits(node, position, end):
                        break  # (a longer span holds more)
                    offer(i + 1, end, extend(known, node, position, end))
    for i in range(count + 1):
        for position, known in best[i].items():
            if position == total and tail is None:
                _keep(search, known)
            elif position < total and tail is not None and search.fits(tail, position, total):
                search.reached = total
                _keep(search, extend(known, tail, position, total))


def _keep(search: _Search, candidate: _Candidate) -> None:
    if _better(candidate, search.best):
        search.best = candidate


def _replicas(search: _Search, spares: list[Capacity], chain: list[PlanSpan]) -> list[PlanSpan]:
    """Spares that serve a span of the chain (not the head's) nearly as fast as its primary: the slowest span first,
    then the one with the fewest replicas."""
    total = search.costs.total_layers
    counts = {span.layers: 0 for span in chain[1:]}
    replicas: list[PlanSpan] = []
    for spare in sorted(spares, key=lambda node: (node.layer_seconds, node.node)):
        choices = []
        for span in chain[1:]:
            role = "tail" if span.layers[1] == total else "middle"
            if spare.span is not None and spare.span != span.layers:
                continue
            if spare.span is None and (role not in spare.roles or not search.fits(spare, *span.layers)):
                continue
            seconds = search.seconds(spare, *span.layers)
            if seconds <= REPLICA_SLOWDOWN * span.seconds:
                choices.append((-span.seconds, counts[span.layers], span.layers, role, seconds))
        if choices:
            _, _, layers, role, seconds = min(choices)
            counts[layers] += 1
            replicas.append(PlanSpan(spare.node, role, layers, seconds, replica=True))
    return replicas


def _missing(search: _Search, nodes: Sequence[Capacity]) -> str:
    total, reached = search.costs.total_layers, search.reached
    if not nodes:
        return f"no node has joined to serve layers {reached}-{total - 1}"
    if not any("tail" in node.roles or (node.span is not None and node.span[1] == total) for node in nodes):
        return f"no node may be the tail (layers {reached}-{total - 1} and the LM head)"
    need = search.costs.lm_head_bytes + search.costs.layer_bytes[-1] + search.reserve
    if reached == total - 1 or not any(node.memory >= need or node.span is not None for node in nodes):
        return f"layers {reached}-{total - 1} are not served: no tail has room for the LM head and the last layer " \
               f"({_mib(need)})"
    return f"layers {reached}-{total - 1} are not served: the nodes' budgets do not hold them " \
           f"({', '.join(_mib(node.memory) for node in nodes)})"


def _mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"
