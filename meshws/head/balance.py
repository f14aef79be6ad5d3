"""Balancing a chain: the same nodes in the same order, their boundaries moved so the slowest stage is as light as
it can be while one session's time stays within `BALANCE_SLACK` of the fastest chain's. Many sessions go as fast as
the slowest stage; without this, like machines measured a few % apart would put every layer on one. Used by
`placement.plan` on the chain its search found.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..model.costs import ModelCosts

BALANCE_SLACK = 0.05  # one session's time a plan may give up for a lighter slowest stage (`balanced`)

Node = Any  # a `placement.Capacity` (not imported: placement imports this module); balancing reads its `span`


class Search(Protocol):
    """What balancing asks of the planner's search (`placement.Search`)."""

    costs: ModelCosts
    best: tuple | None  # the fastest chain found: (seconds, hops, chain)

    def seconds(self, node: Node, start: int, end: int) -> float: ...

    def fits(self, node: Node, start: int, end: int) -> bool: ...

    def hop(self, node: Node) -> float: ...


def balanced(search: Search, chain: list[tuple[Node, int, int]]) -> list[tuple[Node, int, int]]:
    """The same nodes in the same order, their boundaries moved so the slowest stage is as light as it can be with
    one session's time within BALANCE_SLACK of the fastest chain's (many sessions go as fast as the slowest stage;
    like machines measured a few % apart would put every layer on one): the least such cap on a stage, bisected."""
    total, count = search.costs.total_layers, len(chain)
    if count < 2 or count * total * total > 50_000 or search.best is None:
        return chain
    limit = round(search.best[0] * (1 + BALANCE_SLACK), 9)
    caps = sorted({round(search.seconds(node, begin, stop), 12) for node, _, _ in chain
                   for begin in range(total) for stop in range(begin + 1, total + 1)})
    low, high, found = 0, len(caps) - 1, None
    while low <= high:  # the fastest split under a cap gets no slower as the cap rises
        under = _under(search, chain, caps[middle := (low + high) // 2])
        found, low, high = (under[1], low, middle - 1) if under is not None and round(under[0], 9) <= limit \
            else (found, middle + 1, high)
    return found if found is not None else chain


def _under(search: Search, chain: list[tuple[Node, int, int]],
           cap: float) -> tuple[float, list[tuple[Node, int, int]]] | None:
    """The fastest split over `chain`'s nodes in order (hand-placed spans kept), no stage over `cap` s; or None."""
    total = search.costs.total_layers
    best: dict[int, tuple[float, list[tuple[Node, int, int]]]] = {0: (0.0, [])}  # layer reached -> the fastest
    for index, (node, start, end) in enumerate(chain):
        last, row = index == len(chain) - 1, {}
        for begin, (seconds, spans) in best.items():
            if node.span is not None and begin != start:
                continue
            for stop in [end] if node.span is not None else [total] if last else range(begin + 1, total):
                own = search.seconds(node, begin, stop)
                if own > cap + 1e-12 or not search.fits(node, begin, stop):
                    break  # (and at every later stop: a longer span weighs more)
                candidate = seconds + own + (search.hop(node) if begin else 0.0)
                if stop not in row or candidate < row[stop][0]:
                    row[stop] = (candidate, spans + [(node, begin, stop)])
        best = row
    return best.get(total)

