"""The benchmark's measurements through real node processes, started as a user starts them by hand.

A `full` node at one session and at each session count (for a folder's float weights also
with `--quant int8`); a head + tail mesh on loopback at each session count (with each shard's
busy fraction), a session joining the others, frame sizes; and with `--mesh-quant int8` (float
weights) the same mesh runs again with int8 weights on both nodes; with `--pin` once more with the head and the
tail each on a core of its own (`taskset`), as nodes on separate machines would compute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from ..cores import usable_cores
from .streams import joining_run, median_run, stream_once


def frame_sizes(metrics_text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for mode in ("decode", "prefill"):
            for kind in ("frames_total", "frame_bytes_total"):
                if line.startswith(f'meshws_{kind}{{direction="in",type="fwd_{mode}"}}'):
                    values[f"{mode}_{kind}"] = float(line.split()[-1])
    sizes = {}
    for mode in ("decode", "prefill"):
        frames = values.get(f"{mode}_frames_total", 0)
        if frames:
            sizes[f"{mode}_frame_bytes"] = round(values[f"{mode}_frame_bytes_total"] / frames, 1)
    return sizes


def read_metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return response.read().decode()


def busy_seconds(url: str) -> float:
    for line in read_metrics(url).splitlines():
        if line.startswith("meshws_compute_busy_seconds "):
            return float(line.split()[-1])
    return 0.0


def busy_run(urls: list[str], model_id: str, prompt_ids: list[int], tokens: int, count: int,
             runs: int) -> tuple[dict[str, Any], list[float]]:
    """`median_run` of `count` sessions through the first of `urls` (the head), and the share of the runs' time each
    node's compute worker was busy."""
    before = [busy_seconds(url) for url in urls]
    entry = asyncio.run(median_run(urls[0], model_id, prompt_ids, tokens, count, runs))
    after = [busy_seconds(url) for url in urls]
    return entry, [round((b - a) / sum(entry["runs_wall_s"]), 3) for a, b in zip(before, after)]


def measure_processes(args: argparse.Namespace, dtype: str, prompt_ids: list[int], model_id: str) -> dict[str, Any]:
    """Nodes started as a user starts them by hand (default flags: they split the cores themselves)."""
    from .launch import Mesh

    common = ("--model", args.model, "--dtype", dtype)
    results: dict[str, Any] = {"full_node_sessions": {}}
    kinds = (("full_node", ()), ("full_node_int8", ("--quant", "int8")))[: 1 if args.gguf else 2]  # (float weights)
    for name, extra in kinds:
        full = Mesh([("full", f"0-{args.layers - 1}")], common=(*common, *extra), split_threads=False)
        try:
            asyncio.run(stream_once(full.head.url, model_id, prompt_ids, 4))  # warm-up
            results[name] = asyncio.run(median_run(full.head.url, model_id, prompt_ids, args.tokens, 1, args.runs))
            for count in args.sessions if name == "full_node" else ():
                results["full_node_sessions"][str(count)] = asyncio.run(
                    median_run(full.head.url, model_id, prompt_ids, args.tokens, count, args.runs))
        finally:
            full.stop()
    quants = sorted({"none"} if args.gguf else set(args.mesh_quant), key=lambda quant: quant != "none")
    for index, quant in enumerate(quants):  # float first: the joining run and frames come from it
        key = "mesh" if quant == "none" else f"mesh_{quant}"
        results.update(measure_mesh(args, (*common, "--quant", quant), prompt_ids, model_id, key, first=index == 0))
    pin = getattr(args, "pin", False) and hasattr(os, "sched_getaffinity") and usable_cores() >= 2  # (taskset: Linux)
    if pin:  # the head on one core, the tail on the next
        results.update(measure_mesh(args, (*common, "--quant", "none"), prompt_ids, model_id, "mesh_pinned",
                                    first=False, cpus=[str(core) for core in sorted(os.sched_getaffinity(0))[:2]]))
    return results


def measure_mesh(args: argparse.Namespace, flags: tuple[str, ...], prompt_ids: list[int], model_id: str, key: str,
                 first: bool, cpus: list[str] | None = None) -> dict[str, Any]:
    """A head + tail mesh at each session count (`cpus`: each node on those cores alone, `taskset`); the first one
    measured also gives the joining run and frames."""
    from .launch import Mesh

    split = args.tail_start  # as `meshws mesh` splits: both nodes read about the same weight bytes a step
    mesh = Mesh([("head", f"0-{split - 1}"), ("tail", f"{split}-{args.layers - 1}")], common=flags,
                split_threads=False, cpus=cpus)
    results: dict[str, Any] = {key: {}}
    try:
        for node in mesh.nodes:  # each has seen the other (`cores`) before anything is timed
            while node.health()["compute"].get("threads", 0) > max(1, usable_cores() // 2):
                time.sleep(0.5)
        asyncio.run(stream_once(mesh.head.url, model_id, prompt_ids, 4))  # warm-up
        for count in args.sessions:
            entry, shares = busy_run([node.url for node in mesh.nodes], model_id, prompt_ids, args.tokens, count,
                                     args.runs)
            entry["busy_fraction"] = dict(zip(("head", "tail"), shares))
            results[key][str(count)] = entry
        if first:
            busy = max(args.sessions) - 1
            joins = [asyncio.run(joining_run(mesh.head.url, model_id, prompt_ids, args.tokens * 2, busy))
                     for _ in range(max(1, args.runs))]
            results["joining"] = {"busy_sessions": busy,
                                  "ttft_s": round(statistics.median(join["ttft_s"] for join in joins), 4),
                                  "runs_ttft_s": [join["ttft_s"] for join in joins]}
            results["wire"] = frame_sizes(read_metrics(mesh.tail.url))
            results["wire"]["prefill_tokens"] = len(prompt_ids)
    finally:
        mesh.stop()
    return results
