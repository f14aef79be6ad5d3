"""Which of the kernels' paths a product of a few rows takes, measured on this CPU as a node starts.

A 32-value block type whose codes the kernels shuffle in registers (Q4_0, Q4_1, Q8_0) multiplies a lone row, or
a few, straight from the blocks as they lie, and more rows on tiles laid out once for all of them (`blocks32.c`).
Where one gives way to the other depends on the CPU (its caches, how fast it issues `vpdpbusd`, how many cores
share the memory) and on the shapes: the library's defaults were measured on one Zen 4. So a node times both
paths on one of its own weights of each such type, for 1 to `MOST_ROWS` rows, and keeps the direct path for as
many rows as it won on from one row up (`direct_rows`).

Both paths compute the same integer sums in the same order per output, so they give the same bits (the block-type
tests hold them equal): the choice moves speed alone, never a token, and a replayed greedy answer is the one given
whichever path a node chose. `/health` shows the choice and the figures (`compute.products`, `compute.paths`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Iterable

import torch

from ..gguf.block_types import BlockTensor
from .native import Kernels

MOST_ROWS = 6  # rows measured (the defaults switch at 2; before the tiles got cheaper, at 3 or 4)
ROUNDS = 5  # each path's best of this many, the two alternating so that the machine's drift hits both alike
BUDGET_S = 0.5  # a type's measurement stops early past this (a large LM head on a slow machine)


def direct_rows(timings: dict[int, tuple[float, float]]) -> int:
    """Rows that should run straight from the blocks, from (direct, tiles) times by row count: as many as the
    direct path was faster for, counting from one row and stopping at the first count it lost."""
    rows = 0
    for count in sorted(timings):
        direct, tiles = timings[count]
        if count != rows + 1 or direct >= tiles:
            break
        rows = count
    return rows


def typical_weights(weights: Iterable[BlockTensor], types: Iterable[int]) -> dict[int, BlockTensor]:
    """For each of `types`, the weight to measure on: one of the shape that holds most of that type's bytes here
    (the products a step spends most on), so a head is timed on its layers and a tail on its LM head if that
    outweighs them."""
    wanted, bytes_of = set(types), defaultdict(int)
    first: dict[tuple[int, tuple[int, ...]], BlockTensor] = {}
    for weight in weights:
        if weight.type_id in wanted:
            key = (weight.type_id, tuple(weight.shape))
            bytes_of[key] += weight.nbytes
            first.setdefault(key, weight)
    chosen: dict[int, BlockTensor] = {}
    for key in sorted(bytes_of, key=bytes_of.__getitem__, reverse=True):
        chosen.setdefault(key[0], first[key])
    return chosen


def _time(kernels: Kernels, rows: torch.Tensor, weight: BlockTensor, threads: int, path: str) -> float:
    begin = time.perf_counter()
    kernels.qlinear(rows, weight, None, threads, path)
    return time.perf_counter() - begin


def measure(kernels: Kernels, weight: BlockTensor, threads: int, most_rows: int = MOST_ROWS,
            rounds: int = ROUNDS, budget_s: float = BUDGET_S) -> dict[int, tuple[float, float]]:
    """(direct, tiles) seconds of a product of 1 .. most_rows rows with `weight`, each its best of `rounds`."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(most_rows, weight.shape[1], generator=generator)
    kernels.qlinear(rows, weight, None, threads, "tiles")  # (pages the weight in and makes the tiles' tables)
    best: dict[int, list[float]] = {count: [float("inf")] * 2 for count in range(1, most_rows + 1)}
    deadline = time.perf_counter() + budget_s
    order = [(count, side) for _ in range(rounds) for count in best for side in (0, 1)]  # (the paths alternate)
    for number, (count, side) in enumerate(order):
        if number >= 2 * most_rows and time.perf_counter() > deadline:  # (each count timed once, whatever the budget)
            break
        path = ("direct", "tiles")[side]
        best[count][side] = min(best[count][side], _time(kernels, rows[:count], weight, threads, path))
    return {count: (pair[0], pair[1]) for count, pair in best.items()}


def choose_paths(kernels: Kernels, weights: Iterable[BlockTensor], threads: int) -> dict[str, Any]:
    """Measures the paths of each 32-value type among `weights` that has two, sets the kernels' choice, and returns
    what was measured, by type name (also kept in `kernels.measured_paths`, which /health reads)."""
    facts: dict[str, Any] = {}
    for type_id, weight in typical_weights(weights, kernels.direct_types).items():
        name = kernels.block_types[type_id]
        known = kernels.measured_paths.get(name)
        if known and known["shape"] == list(weight.shape) and known["threads"] == threads:
            facts[name] = known  # (another shard in this process: the same library, CPU and shape)
            continue
        began = time.perf_counter()
        timings = {count: (round(direct * 1e6, 1), round(tiles * 1e6, 1))  # (the rule reads what /health shows)
                   for count, (direct, tiles) in measure(kernels, weight, threads).items()}
        rows = kernels.set_direct_rows(type_id, direct_rows(timings))
        facts[name] = {
            "direct_rows": rows, "weight": weight.name, "shape": list(weight.shape), "threads": threads,
            "microseconds": {str(count): {"direct": direct, "tiles": tiles}
                             for count, (direct, tiles) in timings.items()},
            "seconds": round(time.perf_counter() - began, 3)}
    kernels.measured_paths.update(facts)
    return facts
