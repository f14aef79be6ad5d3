"""Routes: which nodes a generation crosses, and whether a chain covers every layer.

A route is the head's span plus the hops after it; the head sends the hops
after the first one in `open`, and each shard forwards the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .link import Link


@dataclass
class Route:
    link: Link | None  # the head's link to the first hop; None on a full node
    hops: list[dict[str, Any]] = field(default_factory=list)  # hops after the first, sent in `open`
    view: list[dict[str, Any]] = field(default_factory=list)  # every node and its layers, for people


def chain_gaps(spans: list[tuple[int, int]], total_layers: int, start: int = 0) -> list[str]:
    """What is wrong with a chain of half-open spans meant to cover [start, total) in order.

    Each problem is said in inclusive layer numbers, as on the command line.
    """
    problems: list[str] = []
    position = start
    for start, end in spans:
        if start > position:
            problems.append(f"layers {position}-{start - 1} are not served")
        elif start < position:
            problems.append(f"layers {start}-{min(end, position) - 1} are served twice")
        position = max(position, end)
    if position < total_layers:
        problems.append(f"layers {position}-{total_layers - 1} are not served")
    return problems
