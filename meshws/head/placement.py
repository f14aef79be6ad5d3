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

import collections
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..model.costs import ModelCosts
from .balance import balanced

if TYPE_CHECKING:
    from .routes import NodeRecord

RESERVE_TOKENS = 2048  # KV positions each placed layer keeps room for (one session of 1,000-odd tokens: buffers grow
# half as much again as they hold)
HOP_SECONDS = 0.001  # what a hop costs beyond its link's round trip: frames, the event loops, a wake-up
REPLICA_SLOWDOWN = 1.5  # a spare may replicate a span it runs at most this much slower than the primary
EXACT_ORDERS_UP_TO = 3  # automatic middles whose every order is tried
MAX_CANDIDATES = 12  # automatic nodes considered (fastest first): a plan takes tens of ms, not seconds
UNMEASURED = 1.0  # seconds per mean layer assumed for a node that has not said (a very slow node)


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

    def summary(self) -> str:
        """The plan in a log line."""
        if not self.spans:
            return self.missing
        return ", ".join(f"{span.node} {span.layers[0]}-{span.layers[1] - 1}{' (replica)' if span.replica else ''}"
                         for span in self.spans) + f"; {self.seconds_per_token * 1000:.1f} ms per token predicted"

    def describe(self) -> dict[str, Any]:
        view: dict[str, Any] = {"version": self.version, "spans": [span.describe() for span in self.spans]}
        if self.spans:
            view["ms_per_token"] = round(self.seconds_per_token * 1000, 2)
        if self.left_out:
            view["left_out"] = list(self.left_out)
        if self.missing:
            view["missing"] = self.missing
        return view


def span_fits(costs: ModelCosts, memory: int, start: int, end: int, reserve_tokens: int = RESERVE_TOKENS) -> bool:
    """Whether a budget of `memory` bytes holds `[start, end)`: its weights (the embeddings from layer 0, the LM head
    through the last), and room for `reserve_tokens` of KV per layer."""
    return costs.weight_bytes(start, end) + reserve_tokens * costs.kv_bytes_per_token * (end - start) <= memory


def chain_seconds(plan_: Plan, nodes: dict[str, Capacity], costs: ModelCosts,
                  lm_factor: float = 1.0) -> tuple[float, float]:
    """A plan's time per token at these nodes' speeds and links, and its slowest stage's (many sessions' pace)."""
    search = Search(costs, 0, lm_factor)
    stages = [search.seconds(nodes[span.node], *span.layers) for span in plan_.chain]
    hops = [search.hop(nodes[span.node]) for span in plan_.chain[1:]]
    return sum(stages) + sum(hops), max(stages)


_Chain = tuple  # a chain so far, as a linked list: (the chain before, node, start, end), or () before the head
_Candidate = tuple[float, int, _Chain]  # (seconds, hops, the chain)


def _better(candidate: _Candidate, known: _Candidate | None) -> bool:
    """Faster (to a nanosecond), then fewer hops."""
    return known is None or (round(candidate[0], 9), candidate[1]) < (round(known[0], 9), known[1])


def _spans_of(chain: _Chain) -> list[tuple[Capacity, int, int]]:
    spans = []
    while chain:
        chain, node, start, end = chain
        spans.append((node, start, end))
    return spans[::-1]


@dataclass
class Search:
    """One planning run's inputs and the best chain found so far."""

    costs: ModelCosts
    reserve: int  # KV bytes each placed layer keeps room for
    lm_factor: float = 1.0  # the LM head's seconds per mean layer, over the layers'
    best: _Candidate | None = None
    reached: int = 0  # the furthest layer any partial chain reached
    prefix: list[int] = field(default_factory=list)  # layer bytes before each position
    held: list[int] = field(default_factory=list)  # ... with each layer's KV reserve
    work: list[float] = field(default_factory=list)  # layer units (mean layers) before each position

    def __post_init__(self) -> None:
        self.prefix = [0, *itertools.accumulate(self.costs.layer_bytes)]
        self.held = [size + self.reserve * index for index, size in enumerate(self.prefix)]
        mean = max(1.0, self.costs.mean_layer_bytes)
        self.work = [size / mean for size in self.prefix]

    def fits(self, node: Capacity, start: int, end: int) -> bool:
        if node.span is not None:
            return True  # placed by hand: it holds what it holds
        costs = self.costs
        held = self.held[end] - self.held[start] + (costs.embedding_bytes if start == 0 else 0) + \
            (costs.lm_head_bytes if end == costs.total_layers else 0)
        return held <= node.memory

    def seconds(self, node: Capacity, start: int, end: int) -> float:
        lm_head = self.costs.lm_head_units * self.lm_factor if end == self.costs.total_layers else 0.0
        return node.layer_seconds * (self.costs.units(start, end) + lm_head)

    def hop(self, node: Capacity) -> float:
        return node.link_seconds + HOP_SECONDS

    def extend(self, known: _Candidate, node: Capacity, start: int, end: int) -> _Candidate:
        return known[0] + self.seconds(node, start, end) + self.hop(node), known[1] + 1, (known[2], node, start, end)


def plan(head: Capacity, nodes: Sequence[Capacity], costs: ModelCosts, version: int = 0,
         reserve_tokens: int = RESERVE_TOKENS, lm_factor: float = 1.0, keep: Plan | None = None) -> Plan:
    """The fastest chain that fits every budget, with replicas and left-out nodes; `missing` says why none does.
    With `keep`, that plan's chain and replicas stay (while their nodes may hold their spans) and only the nodes it
    left out are weighed, as new replicas."""
    total = costs.total_layers
    search = Search(costs, reserve_tokens * costs.kv_bytes_per_token, lm_factor)
    if keep is not None and (kept := _kept(search, keep, head, nodes, version, reserve_tokens)) is not None:
        return kept
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
            _chain(search, head, heads, list(order), fixed, tail)
    if search.best is None:
        return Plan(version, left_out=tuple(node.node for node in nodes), missing=_missing(search, nodes))
    chain = balanced(search, _spans_of(search.best[2]))
    return _with_replicas(search, version, nodes, [
        PlanSpan(node.node, "head" if start == 0 else "tail" if end == total else "middle", (start, end),
                 search.seconds(node, start, end)) for node, start, end in chain], [node for node, _, _ in chain])


def _with_replicas(search: Search, version: int, nodes: Sequence[Capacity], chain: list[PlanSpan],
                   members: list[Capacity], kept: Sequence[PlanSpan] = ()) -> Plan:
    """The plan of `chain` (run by `members`, in order) with the replicas `kept`, and the spares among `nodes` that
    may replicate it."""
    seconds = sum(span.seconds for span in chain) + sum(search.hop(node) for node in members[1:])
    used = {span.node for span in (*chain, *kept)}
    replicas = [*kept, *_replicas(search, [node for node in nodes if node.node not in used], chain)]
    used |= {span.node for span in replicas}
    return Plan(version, tuple(chain + replicas), seconds, tuple(node.node for node in nodes if node.node not in used))


def _kept(search: Search, keep: Plan, head: Capacity, nodes: Sequence[Capacity], version: int,
          reserve_tokens: int) -> Plan | None:
    """`keep`'s chain and replicas as they are, at today's speeds, with the spares that may replicate its spans now;
    None when a node of its chain is gone or may no longer hold its span (a replica that may not is dropped)."""
    known = {node.node: node for node in (head, *nodes)}
    held = [dataclasses.replace(span, seconds=search.seconds(known[span.node], *span.layers)) for span in keep.spans
            if span.node in known and holds(search.costs, known[span.node], span, reserve_tokens)]
    chain = [span for span in held if not span.replica]
    if not chain or len(chain) != len(keep.chain):
        return None
    return _with_replicas(search, version, nodes, chain, [known[span.node] for span in chain],
                          [span for span in held if span.replica])


def holds(costs: ModelCosts, node: Capacity, span: PlanSpan, reserve_tokens: int = RESERVE_TOKENS) -> bool:
    """Whether `node` may still serve `span` of a plan: its own span placed by hand, or a role and a budget that
    allow it."""
    if node.span is not None:
        return node.span == span.layers
    return (span.role == "head" or span.role in node.roles) and span_fits(costs, node.memory, *span.layers,
                                                                          reserve_tokens)


def _chain(search: Search, head: Capacity, heads: list[tuple[int, float]], middles: list[Capacity],
           fixed: list[Capacity], tail: Capacity | None) -> None:
    """The fastest chain with the middles taken in this order (each a span or none) and `tail` last (or a fixed
    tail); kept in `search` if better than its best. Row i holds, by the layer reached, the best chain having weighed
    the first i middles; a middle's spans come from a window of the row before (`_take`): linear in the layers."""
    total = search.costs.total_layers
    row: dict[int, _Candidate] = {}
    for end, seconds in heads:
        row[end] = (seconds, 0, ((), head, 0, end))
    rows = [_with_fixed(search, row, fixed, tail)]
    for node in middles:
        rows.append(_with_fixed(search, _take(search, rows[-1], node), fixed, tail))
    for row in rows:
        for position, known in row.items():
            search.reached = max(search.reached, position)
            if position == total and tail is None:
                _keep(search, known)
            elif position < total and tail is not None and search.fits(tail, position, total):
                search.reached = total
                _keep(search, search.extend(known, tail, position, total))


def _take(search: Search, row: dict[int, _Candidate], node: Capacity) -> dict[int, _Candidate]:
    """The next row: every chain of `row` as it is (this middle takes nothing), or with `node` taking a span
    [p, q) after it. The best p for each q is the least (seconds - speed x work before p) among the p whose span to
    q fits the budget: a window that only moves forward, kept as a queue of rising values."""
    total, speed = search.costs.total_layers, node.layer_seconds
    taken = dict(row)
    starts = sorted(position for position in row if position < total)
    queue: collections.deque[int] = collections.deque()
    added = 0

    def value(position: int) -> tuple[float, int]:
        return row[position][0] - speed * search.work[position], row[position][1]

    for end in range(1, total):
        while added < len(starts) and starts[added] < end:
            position = starts[added]
            while queue and value(queue[-1]) >= value(position):
                queue.pop()
            queue.append(position)
            added += 1
        while queue and not search.fits(node, queue[0], end):
            queue.popleft()  # (its span to this end is too big: to every later end too)
        if queue:
            candidate = search.extend(row[queue[0]], node, queue[0], end)
            if _better(candidate, taken.get(end)):
                taken[end] = candidate
    return taken


def _with_fixed(search: Search, row: dict[int, _Candidate], fixed: list[Capacity],
                tail: Capacity | None) -> dict[int, _Candidate]:
    """`row` with the hand-placed nodes whose spans start where a chain of it ends (in order: one may follow
    another)."""
    total = search.costs.total_layers
    for position in range(total):
        known = row.get(position)
        if known is None:
            continue
        for node in fixed:
            if node.span is not None and node.span[0] == position and (node.span[1] < total or tail is None):
                candidate = search.extend(known, node, *node.span)
                if _better(candidate, row.get(node.span[1])):
                    row[node.span[1]] = candidate
    return row


def _keep(search: Search, candidate: _Candidate) -> None:
    if _better(candidate, search.best):
        search.best = candidate


def _replicas(search: Search, spares: list[Capacity], chain: list[PlanSpan]) -> list[PlanSpan]:
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


def _missing(search: Search, nodes: Sequence[Capacity]) -> str:
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


def _mib(count: float) -> str:  # (for people)
    return f"{count / 2**20:.0f} MiB"


def probe_span(total_layers: int) -> tuple[int, int]:
    """The one layer an automatic node outside the plan holds (to measure its speed on): layer 1, as it starts."""
    return (1, 2) if total_layers > 2 else (1, total_layers)


def capacity(record: NodeRecord) -> Capacity:
    """A joined node as the planner sees it."""
    return Capacity(record.url, record.layer_seconds or UNMEASURED, record.memory or 0, record.link_seconds,
                    None if record.auto else record.layers, frozenset(record.roles))
