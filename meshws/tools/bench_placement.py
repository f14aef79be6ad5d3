"""`python -m meshws.bench --suite placement`: the head's automatic plan against the best hand-placed chain, on
machines simulated on one host (`machines`), and the plan's moves while answers stream.

The scenario is issue 60's: a head on core 0 and two joiners on core 1, one at a full core and one at
`--slow-share` of one, every node `--node-memory` (no node holds the model), drafts off, links in float32, the
default dtype. In one run, on one automatic mesh, then hand-placed chains:
1. *plan*: the automatic plan's decode (ms per token), against hand-placed chains (explicit `--layers`, the same
   quotas and budgets, run last): every chain the budgets allow is predicted from the speeds the nodes measured,
   and the `--chains` best predicted (with the automatic plan's own) are started and measured; the best measured
   is the baseline;
2. *swap*: the joiners trade speeds while a `--long-tokens` answer streams: seconds from the swap until a new plan
   is in force, the answer against a full node's (text), and the decode afterwards over the baseline (the
   machines trade places, so the same chains stand);
3. *join*: a fourth node (a full core 0) joins: seconds until the plan gives it layers;
4. *leave*: a node of the plan gets SIGTERM while an answer streams: seconds until the plan re-forms without it,
   and the answer against a full node's.
Each node's log is kept beside the report (`logs/`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..config import parse_size
from ..head.placement import HOP_SECONDS
from ..model.costs import ModelCosts, gguf_costs
from .launch import NodeProcess, free_port
from .machines import Machine, wait_for_plan
from .streams import stream_once

LEAVE_TOKENS = 300


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-memory", default="300M", help="placement: each simulated machine's --memory")
    parser.add_argument("--slow-share", type=float, default=0.15, help="placement: the slow machine's share of a core")
    parser.add_argument("--chains", type=int, default=4, help="placement: hand-placed chains measured")
    parser.add_argument("--long-tokens", type=int, default=1000, help="placement: the answer the machines swap under")


def run_placement(model: str, prompt_ids: list[int], model_id: str, memory: str, slow: float, tokens: int,
                  long_tokens: int, chains: int, logs: Path) -> dict[str, Any]:
    """Every figure of the scenario (the module's docstring), as a report section."""
    gguf = Path(model)
    costs = gguf_costs(gguf)
    budget = parse_size(memory)
    common = ("--model", model, "--draft", "none", "--wire-dtype", "float32", "--memory", memory)
    report: dict[str, Any] = {"model": gguf.name, "memory": memory, "slow_share": slow, "tokens": tokens}
    print("placement: a full node's answers (the reference) ...", flush=True)
    full = Machine("--role", "full", "--model", model, "--draft", "none", name="full", core=0)
    try:
        full.node.wait_started()
        reference = {count: _answer(full.node.url, model_id, prompt_ids, count)[0]
                     for count in (long_tokens, LEAVE_TOKENS)}
    finally:
        full.stop()

    mesh = _AutoMesh(common, slow, logs)
    try:
        plan = mesh.wait_plan(lambda p: bool(p["spans"]), 180)
        auto = min(_decode_ms(mesh.url, model_id, prompt_ids, tokens) for _ in range(2))  # (as each chain's)
        speeds = mesh.speeds()
        report["plan"] = {"spans": plan["spans"], "predicted_ms": plan.get("ms_per_token"), "decode_ms": auto,
                          "speeds_ms": speeds}
        print(f"placement: automatic plan {_spans(plan)}: {auto} ms per token", flush=True)
        roles = mesh.role_of(plan)
        version = mesh.plan()["version"]
        swapped: list[float] = []

        def swap(chunks: int) -> None:
            if chunks == 50 and not swapped:
                mesh.fast.set_share(slow)
                mesh.slow.set_share(1.0)
                swapped.append(time.monotonic())

        watch = _Watch(mesh, lambda p: p["version"] > version and p["state"] == "live")
        text, gaps = _answer(mesh.url, model_id, prompt_ids, long_tokens, swap)
        after = min(_decode_ms(mesh.url, model_id, prompt_ids, tokens) for _ in range(2))
        report["swap"] = {"replan_s": watch.seconds_since(swapped[0]) if swapped else None,
                          "identical": text == reference[long_tokens], "max_gap_s": round(max(gaps), 3),
                          "plan_after": _spans(mesh.plan()), "decode_ms_after": after}
        print(f"placement: swap {report['swap']}", flush=True)

        joined = time.monotonic()
        fourth = mesh.join("fourth", 0, 1.0)
        fourth_url = f"ws://127.0.0.1:{fourth.node.wait_started().port}"
        mesh.wait_plan(lambda p: fourth_url in {span["node"] for span in p["spans"]}, 120)
        report["join"] = {"layers_s": round(time.monotonic() - joined, 1), "plan": _spans(mesh.plan())}
        print(f"placement: join {report['join']}", flush=True)

        leaver = next(m for m in mesh.joiners if m.node.port and _url(m) in {s["node"] for s in mesh.plan()["spans"]})
        version, left = mesh.plan()["version"], []

        def leave(chunks: int) -> None:
            if chunks == 30 and not left:
                leaver.node.proc.terminate()
                left.append(time.monotonic())

        watch = _Watch(mesh, lambda p: p["version"] > version and p["state"] == "live"
                       and _url(leaver) not in {span["node"] for span in p["spans"]})
        text, _ = _answer(mesh.url, model_id, prompt_ids, LEAVE_TOKENS, leave)
        watch.thread.join(120)
        report["leave"] = {"reform_s": watch.seconds_since(left[0]) if left else None,
                           "identical": text == reference[LEAVE_TOKENS], "plan": _spans(mesh.plan())}
        print(f"placement: leave {report['leave']}", flush=True)
    finally:
        mesh.stop()  # (the hand-placed chains run on the same cores)
    hand = _hand_placed(costs, budget, speeds, roles, chains, common, slow, model_id, prompt_ids, tokens)
    best = min(hand, key=lambda chain: chain["decode_ms"])
    report["hand_placed"] = hand
    report["plan"]["over_best_hand_placed"] = round(auto / best["decode_ms"], 3)
    report["swap"]["after_over_best_hand_placed"] = round(report["swap"]["decode_ms_after"] / best["decode_ms"], 3)
    report["targets"] = {
        "plan_le_1_10x_best_hand_placed": report["plan"]["over_best_hand_placed"] <= 1.10,
        "replan_within_45_s": (report["swap"]["replan_s"] or 1e9) <= 45,
        "swap_tokens_identical": report["swap"]["identical"],
        "after_swap_le_1_20x_best_hand_placed": report["swap"]["after_over_best_hand_placed"] <= 1.20,
        "join_layers_within_30_s": report["join"]["layers_s"] <= 30,
        "leave_reform_within_30_s": (report["leave"]["reform_s"] or 1e9) <= 30,
        "leave_tokens_identical": report["leave"]["identical"],
    }
    return report


class _AutoMesh:
    """The automatic mesh: a head on core 0, a fast and a slow joiner on core 1."""

    def __init__(self, common: tuple[str, ...], slow: float, logs: Path) -> None:
        self.common, self.port, self.logs = common, free_port(), logs
        self.head = Machine("--role", "head", "--layers", "auto", *common, name="head", core=0, port=self.port)
        self.joiners: list[Machine] = []
        self.fast = self.join("fast", 1, 1.0)
        self.slow = self.join("slow", 1, slow)
        for machine in [self.head, *self.joiners]:
            machine.node.wait_started(300)

    @property
    def url(self) -> str:
        return self.head.node.url

    def join(self, name: str, core: int, share: float) -> Machine:
        machine = Machine("--role", "auto", "--layers", "auto", *self.common, "--join",
                          f"http://127.0.0.1:{self.port}", name=name, core=core, share=share)
        self.joiners.append(machine)
        return machine

    def plan(self) -> dict[str, Any]:
        return self.head.node.health()["plan"]

    def wait_plan(self, check: Callable[[dict], bool], timeout: float) -> dict[str, Any]:
        return wait_for_plan(self.head.node, check, timeout)

    def speeds(self) -> dict[str, Any]:
        """Each machine's measured ms per mean layer (and the LM head's factor)."""
        health = self.head.node.health()
        found = {"head": health["capacity"]["layer_ms"], "lm_head_factor": health["plan"].get("lm_head_factor", 1.0)}
        for name, machine in (("fast", self.fast), ("slow", self.slow)):
            found[name] = machine.node.health()["capacity"]["layer_ms"]
        return found

    def role_of(self, plan: dict[str, Any]) -> dict[tuple[int, int], str]:
        names = {_url(machine): name for name, machine in (("fast", self.fast), ("slow", self.slow))}
        return {tuple(span["layers"]): names.get(span["node"], span["node"]) for span in plan["spans"]}

    def stop(self) -> None:
        """Stop every machine; each node's log goes to `logs`/NAME.log."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for machine in [*self.joiners, self.head]:
            machine.stop()
            (self.logs / f"{machine.node.name}.log").write_text("\n".join(machine.node.lines) + "\n")


class _Watch:
    """Polls the head's plan in a thread until `check`; when that first held."""

    def __init__(self, mesh: _AutoMesh, check: Callable[[dict], bool]) -> None:
        self.when: float | None = None

        def poll() -> None:
            deadline = time.monotonic() + 600
            while self.when is None and time.monotonic() < deadline:
                try:
                    if check(mesh.plan()):
                        self.when = time.monotonic()
                except OSError:
                    pass
                time.sleep(0.25)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()

    def seconds_since(self, start: float) -> float | None:
        self.thread.join(120)
        return None if self.when is None else round(self.when - start, 1)


def _hand_placed(costs: ModelCosts, budget: int, speeds: dict[str, Any], auto: dict[tuple[int, int], str],
                 count: int, common: tuple[str, ...], slow: float, model_id: str, prompt_ids: list[int],
                 tokens: int) -> list[dict[str, Any]]:
    """The `count` best predicted hand-placed chains (head, a middle, a tail), started and measured."""
    from ..head.placement import RESERVE_TOKENS

    total, reserve = costs.total_layers, RESERVE_TOKENS * costs.kv_bytes_per_token
    factor = speeds.get("lm_head_factor") or 1.0

    def fits(start: int, end: int) -> bool:
        return costs.weight_bytes(start, end) + reserve * (end - start) <= budget

    def seconds(name: str, start: int, end: int) -> float:
        lm_head = costs.lm_head_units * factor if end == total else 0.0
        return (speeds[name] or 1.0) / 1000 * (costs.units(start, end) + lm_head)

    found = []
    for a, b in itertools.combinations(range(1, total), 2):
        for middle, tail in (("fast", "slow"), ("slow", "fast")):
            if fits(0, a) and fits(a, b) and fits(b, total):
                found.append((seconds("head", 0, a) + seconds(middle, a, b) + seconds(tail, b, total)
                              + 2 * HOP_SECONDS, a, b, middle, tail))
    found.sort()
    automatic = [chain for chain in found if auto.get((0, chain[1])) == "head" and auto.get(chain[1:3]) == chain[3]
                 and auto.get((chain[2], total)) == chain[4]]  # the automatic plan's own chain, placed by hand
    chosen = found[:count] + [chain for chain in automatic if chain not in found[:count]]
    results = []
    for predicted, a, b, middle, tail in chosen:
        decode = _run_chain(common, slow, (a, b), middle, tail, total, model_id, prompt_ids, tokens)
        results.append({"layers": [[0, a], [a, b], [b, total]], "middle": middle, "tail": tail,
                        "predicted_ms": round(predicted * 1000, 2), "decode_ms": decode})
        print(f"placement: by hand head 0-{a - 1}, {middle} {a}-{b - 1}, {tail} {b}-{total - 1}: {decode} ms per "
              f"token (predicted {predicted * 1000:.1f})", flush=True)
    return results


def _run_chain(common: tuple[str, ...], slow: float, cut: tuple[int, int], middle: str, tail: str, total: int,
               model_id: str, prompt_ids: list[int], tokens: int) -> float:
    """One hand-placed chain on the same simulated machines: its decode, ms per token (the better of two runs)."""
    port = free_port()
    shares = {"fast": 1.0, "slow": slow}
    machines = [Machine("--role", "head", "--layers", f"0-{cut[0] - 1}", *common, name="hand-head", core=0,
                        port=port)]
    try:
        join = ("--join", f"http://127.0.0.1:{port}", *common)
        machines.append(Machine("--role", "middle", "--layers", f"{cut[0]}-{cut[1] - 1}", *join,
                                name=f"hand-{middle}", core=1, share=shares[middle]))
        machines.append(Machine("--role", "tail", "--layers", f"{cut[1]}-{total - 1}", *join,
                                name=f"hand-{tail}", core=1, share=shares[tail]))
        for machine in machines:
            machine.node.wait_started(300)
        _wait_ready(machines[0].node)
        return min(_decode_ms(machines[0].node.url, model_id, prompt_ids, tokens) for _ in range(2))
    finally:
        for machine in reversed(machines):
            machine.stop()


def _wait_ready(node: NodeProcess, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not node.health()["ready"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node.name} not ready: {node.health()['problems']}")
        time.sleep(0.3)


def _decode_ms(url: str, model_id: str, prompt_ids: list[int], tokens: int) -> float:
    run = asyncio.run(stream_once(url, model_id, prompt_ids, tokens))
    return round(1000 / run["decode_tok_s"], 2)


def _answer(url: str, model_id: str, prompt_ids: list[int], tokens: int,
            on_chunk: Callable[[int], None] | None = None) -> tuple[str, list[float]]:
    """A greedy answer of `tokens` tokens, streamed: its text and the gaps between its chunks."""
    import urllib.request

    body = {"model": model_id, "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    parts: list[str] = []
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=1800) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the answer failed: {chunk['error']}")
            parts.append(chunk["choices"][0]["text"])
            times.append(time.monotonic())
            if on_chunk is not None:
                on_chunk(len(parts))
    return "".join(parts), [b - a for a, b in zip(times, times[1:])]


def write_placement_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Decode time per token of each hand-placed chain measured, the automatic plan's, and the plan's after the
    machines traded speeds (none without matplotlib: `pip install meshws[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(f"by hand: head 0-{c['layers'][0][1] - 1}, {c['middle']} {c['layers'][1][0]}-{c['layers'][1][1] - 1}, "
             f"{c['tail']} {c['layers'][2][0]}-{c['layers'][2][1] - 1}", c["decode_ms"], "#9aa5b1")
            for c in sorted(report["hand_placed"], key=lambda chain: -chain["decode_ms"])]
    rows += [("automatic plan", report["plan"]["decode_ms"], "#1f77b4"),
             ("automatic, after the machines swapped speeds", report["swap"]["decode_ms_after"], "#2ca02c")]
    figure, axis = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    axis.barh([label for label, _, _ in rows], [value for _, value, _ in rows], color=[color for _, _, color in rows])
    for index, (_, value, _) in enumerate(rows):
        axis.text(value, index, f" {value:.1f}", va="center", fontsize=8)
    axis.set_xlabel("decode, ms per token (lower is better)")
    axis.set_title(f"{report['model']}: the head on one core, two machines on the other (one at "
                   f"{report['slow_share']:.0%} of it),\n--memory {report['memory']} each, drafts off", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _url(machine: Machine) -> str:
    return f"ws://127.0.0.1:{machine.node.port}"


def _spans(plan: dict[str, Any]) -> list[str]:
    return [f"{span['node']} {span['layers'][0]}-{span['layers'][1] - 1}" for span in plan["spans"]]
