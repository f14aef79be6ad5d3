"""`python -m meshws.bench --suite scale`: what every machine added adds (issue 62), drafts off, llama.cpp beside it.

Machines are simulated on this host as `../shared/NOTES.md` describes: each node process pinned to a core of its
own (`taskset`) with a private TMPDIR, so meshws's core sharing (`cores`) finds no other node and takes its core as
its own, as on a separate host. One machine is a `full` node; two (and three, where the host has the cores) are a
head and nodes that join it, every one `--layers auto`: the head places the layers by what each measures
(`placement`), as it places a user's machines. Every count of `--sessions` streams through the OpenAI API as
clients do (the median of `--runs`). Then one host: a head and a tail unpinned, lending each other the host's cores
with `meshws mesh`'s split, beside a full node on all of them: both started at once, each in a TMPDIR of its own (so
the full node, the other idling, has the host's cores as it would alone), and measured in turns (`in_turns`), since
this host's speed drifts by a tenth within minutes while the target is a ratio within a twentieth.

llama.cpp runs beside each: on the first machine's core with one thread, and on every core with as many threads (its
one-sequence decode in the one-host turns too); one sequence's decode (best of three), and as many sequences as
sessions in one context (`bench_llama`). Reported:
each case's spans and aggregate tok/s per session count with each node's busy share, the ratios of the issue's
targets (two machines over one at the most sessions and at one; one host's split over its full node; full nodes
over llama.cpp), and a picture.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..cores import usable_cores
from .bench_nodes import busy_run
from .local_mesh import tail_start
from .launch import NodeProcess, free_port
from .machines import wait_for_plan
from .streams import stream_once

PROMPT = 64  # prompt tokens per session (random ids, the same for every session)
# Seconds a placed mesh's measures must stay off its plan before it plans again: a node's own default. At 3 s a
# two-machine mesh of the embedded model under 16-session runs re-planned 7-13 times in 4 minutes (lone steps at a
# run's start and end read up to 2x apart on simulated machines that share the memory), at 10 s twice, both at start.
REPLAN = 10
SETTLED = 25  # seconds a placed mesh's plan must stay the same before it is measured (longer than REPLAN)


def byte_split(shape: dict[str, int], parts: int) -> list[tuple[str, str]]:
    """`meshws mesh`'s split on one host (`local_mesh.tail_start`: both nodes read about the same weight bytes a
    step, the tail's LM head counted); two parts only."""
    assert parts == 2
    start = tail_start(shape)
    return [("head", f"0-{start - 1}"), ("tail", f"{start}-{shape['layers'] - 1}")]


class Nodes:
    """Node processes, head first; `cores[i]` pins node i (None: unpinned, the host's cores shared). With `spans` the
    chain is placed by hand (`--peer`); with `auto` set to a count of nodes, a head and that many less one joining it,
    every one `--layers auto`, placed by the head's measures (`placement`) as a user's machines are. `home`: the
    TMPDIR of the unpinned nodes (`cores` counts the nodes registered there)."""

    def __init__(self, common: tuple[str, ...], cores: list[int | None],
                 spans: list[tuple[str, str]] | None = None, home: str | None = None) -> None:
        self.nodes: list[NodeProcess] = []
        self.dirs: list[tempfile.TemporaryDirectory] = []
        self.plan: dict[str, Any] | None = None
        ports = [free_port() for _ in cores]
        try:
            for index, core in enumerate(cores):
                if spans is not None:
                    role, layers = spans[index]
                    args = ["--role", role, "--layers", layers, *common]
                    args += ["--peer", f"ws://127.0.0.1:{ports[index + 1]}"] if index + 1 < len(spans) else []
                else:
                    role = "head" if index == 0 else "auto"
                    args = ["--role", role, "--layers", "auto", *common, "--replan-seconds", str(REPLAN)]
                    args += ["--join", f"http://127.0.0.1:{ports[0]}"] if index else []
                env = None
                if core is not None:  # a machine of its own: its core, its TMPDIR
                    self.dirs.append(tempfile.TemporaryDirectory(prefix=f"meshws-scale-{role}-"))
                    env = {"TMPDIR": self.dirs[-1].name}
                elif home is not None:  # unpinned nodes sharing the host's cores with those of `home` alone
                    env = {"TMPDIR": home}
                self.nodes.append(NodeProcess(*args, name=f"{role} {index}", port=ports[index], env=env,
                                              cpus=None if core is None else str(core)))
            for node in self.nodes:
                node.wait_started(300)
            self.nodes[0].wait_ready(300)
            if spans is None:  # every node placed (in the chain or a replica), the plan in force and settled
                self.plan = self._settled(len(cores))
        except BaseException:
            self.stop()
            raise

    def _settled(self, count: int) -> dict[str, Any]:
        """The plan once it has stayed the same for SETTLED seconds: a first plan made on a few probe steps may be
        replaced as the nodes' measures firm up (`--replan-seconds` REPLAN)."""
        plan = wait_for_plan(self.nodes[0], lambda plan: len(plan["spans"]) == count, 300)
        since = time.monotonic()
        while time.monotonic() - since < SETTLED:
            time.sleep(1)
            now = wait_for_plan(self.nodes[0], lambda plan: len(plan["spans"]) == count, 300)
            if now["version"] != plan["version"]:
                plan, since = now, time.monotonic()
        return plan

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        for directory in self.dirs:
            directory.cleanup()


def run_case(nodes: Nodes, model_id: str, prompt: list[int], tokens: int, counts: list[int],
             runs: int) -> dict[str, Any]:
    head = nodes.nodes[0]
    asyncio.run(stream_once(head.url, model_id, prompt, 4))  # warm-up
    found: dict[str, Any] = {}
    for count in counts:
        entry, shares = busy_run([node.url for node in nodes.nodes], model_id, prompt, tokens, count, runs)
        entry["busy_share"] = shares  # node order, head first
        found[str(count)] = entry
        print(f"  {count:>3} sessions: {entry['aggregate_tok_s']} tok/s, busy {entry['busy_share']}", flush=True)
    return found


@contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This thread (and the threads and processes it starts meanwhile) on `cores` alone."""
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def llama_beside(gguf: Path, cores: list[int], prompt: list[int], tokens: int,
                 counts: list[int]) -> dict[str, Any] | None:
    """llama.cpp on `cores` with a thread each: one sequence's decode (best of three) and `counts` sequences at once."""
    from .bench_gguf import LlamaCpp, llama_cpp_available
    from .bench_llama import measure_llama_cpp_sessions

    if not llama_cpp_available():
        return None
    with pinned(set(cores)):
        probe = LlamaCpp(gguf, len(cores), tokens)
        try:
            for _ in range(3):
                probe.decode()
        finally:
            one = probe.close()
        sequences = measure_llama_cpp_sessions(gguf, prompt, tokens, counts, threads=len(cores))
    return {"threads": len(cores), "decode_tok_s": one["decode_tok_s"], "decode_runs": one["decode_runs"],
            "sessions": sequences}


def run_scale(model: str, gguf: Path | None, counts: list[int], tokens: int, runs: int) -> dict[str, Any]:
    from ..model.source import model_shape, resolve_model

    resolved = resolve_model(model, os.environ.get("MESHWS_CACHE_DIR"), tokenizer=False)
    shape = model_shape(resolved)
    cores = sorted(os.sched_getaffinity(0))[:usable_cores()]
    common = ("--model", model, "--draft", "none")
    prompt = [random.Random(62).randrange(100, min(30000, shape["vocab"])) for _ in range(PROMPT)]
    report: dict[str, Any] = {"model": resolved.model_id, "cores": len(cores), "tokens": tokens, "runs": runs,
                              "prompt_tokens": PROMPT, "machines": {}, "one_host": {}}
    full = [("full", f"0-{shape['layers'] - 1}")]
    cases: list[tuple[str, str, list[tuple[str, str]] | None, list[int | None]]] = [
        ("machines", "1", full, [cores[0]])]
    cases += [("machines", str(parts), None, cores[:parts]) for parts in (2, 3) if len(cores) >= parts]
    for group, name, spans, pins in cases:
        print(f"{group} {name}: {spans or 'placed by the head'} on cores {pins}", flush=True)
        nodes = Nodes(common, pins, spans)
        try:
            placed = [(span["node"], span["layers"], span.get("replica", False)) for span in nodes.plan["spans"]] \
                if nodes.plan else spans
            print(f"  spans {placed}", flush=True)
            report[group][name] = {"spans": placed, "cores": pins,
                                   "sessions": run_case(nodes, resolved.model_id, prompt, tokens, counts, runs)}
            if nodes.plan is not None:  # a move while sessions ran parks and prefills them all again: say so
                after = nodes.nodes[0].health()["plan"]
                report[group][name]["moves_while_measured"] = after["moves"] - nodes.plan["moves"]
        finally:
            nodes.stop()
    if len(cores) >= 2:
        print(f"one host: a full node and {byte_split(shape, 2)}, in turns", flush=True)
        report["one_host"], report["one_host_turns"] = in_turns(
            common, {"full": full, "split": byte_split(shape, 2)}, resolved.model_id, prompt, tokens, counts, runs,
            gguf, len(cores))
    if gguf is not None:
        report["llama_cpp"] = llama_beside(gguf, cores[:1], prompt, tokens, counts)
        report["llama_cpp_one_host"] = llama_beside(gguf, cores, prompt, tokens, counts) if len(cores) > 1 else None
    report["ratios"] = ratios(report, counts)
    return report


def in_turns(common: tuple[str, ...], cases: dict[str, list[tuple[str, str]]], model_id: str, prompt: list[int],
             tokens: int, counts: list[int], runs: int, gguf: Path | None,
             threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Hand-placed `cases` on this host's cores, all started, each in a TMPDIR of its own, measured in turns: each
    run of a count goes to every case back to back, the first case first on even turns and last on odd ones, and
    llama.cpp (`gguf`, `threads` threads) decodes one sequence in each turn of one session. Each case's figures are
    the medians of its runs; the turns' ratios to the first case (and the first case's to llama.cpp) are paired,
    run by run, so that the host's drift falls on both sides of each."""
    from .bench_gguf import LlamaCpp, llama_cpp_available

    homes = [tempfile.TemporaryDirectory(prefix=f"meshws-scale-{name}-") for name in cases]
    started: dict[str, Nodes] = {}
    llama = None
    try:
        for (name, spans), home in zip(cases.items(), homes):
            started[name] = Nodes(common, [None] * len(spans), spans, home=home.name)
            asyncio.run(stream_once(started[name].nodes[0].url, model_id, prompt, 4))  # warm-up
        if gguf is not None and 1 in counts and llama_cpp_available():
            llama = LlamaCpp(gguf, threads, tokens)
        first, found, turns = next(iter(cases)), {name: {} for name in cases}, {}
        for count in counts:
            taken: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
            beside: list[float] = []
            for turn in range(max(1, runs)):
                for name in list(cases) if turn % 2 == 0 else list(cases)[::-1]:
                    urls = [node.url for node in started[name].nodes]
                    entry, shares = busy_run(urls, model_id, prompt, tokens, count, 1)
                    taken[name].append({**entry, "busy_share": shares})
                if llama is not None and count == 1:
                    beside.append(llama.decode())
            for name, entries in taken.items():
                found[name][str(count)] = _medians(entries)
                print(f"  {name}, {count:>3} sessions: {found[name][str(count)]['aggregate_tok_s']} tok/s, busy "
                      f"{found[name][str(count)]['busy_share']}", flush=True)
            rates = {name: [_turn_rate(entry, count) for entry in entries] for name, entries in taken.items()}
            turns[str(count)] = {f"{name}_over_{first}": _paired(rates[name], rates[first]) for name in cases
                                 if name != first}
            if beside:
                turns[str(count)][f"{first}_over_llama_cpp"] = _paired(rates[first], beside)
    finally:
        if llama is not None:
            llama.close()
        for nodes in started.values():
            nodes.stop()
        for home in homes:
            home.cleanup()
    return ({name: {"spans": spans, "cores": [None] * len(spans), "sessions": found[name]}
             for name, spans in cases.items()}, turns)


def _turn_rate(entry: dict[str, Any], count: int) -> float:
    return entry["per_session_tok_s"] if count == 1 else entry["aggregate_tok_s"]  # (one: its decode, as llama.cpp's)


def _medians(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry of runs' entries (`busy_run`'s): the median of each figure, each run's aggregate and time kept."""
    merged: dict[str, Any] = {key: round(statistics.median(entry[key] for entry in entries), 4)
                              for key, value in entries[0].items() if isinstance(value, (int, float))}
    merged["runs_aggregate_tok_s"] = [entry["aggregate_tok_s"] for entry in entries]
    merged["runs_wall_s"] = [wall for entry in entries for wall in entry["runs_wall_s"]]
    merged["busy_share"] = [round(statistics.median(shares), 3) for shares in zip(*(e["busy_share"] for e in entries))]
    return merged


def _paired(rates: list[float], bases: list[float]) -> dict[str, Any]:
    """Each turn's ratio and their median."""
    each = [round(rate / base, 3) for rate, base in zip(rates, bases) if base]
    return {"median": round(statistics.median(each), 3) if each else None, "turns": each}


def _rate(report: dict[str, Any], group: str, name: str, count: int) -> float | None:
    entry = report[group].get(name, {}).get("sessions", {}).get(str(count))
    return _turn_rate(entry, count) if entry else None


def _over(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(report: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """The issue's figures: each against its target (None where not measured)."""
    most, llama = max(counts), report.get("llama_cpp") or {}
    turns = (report.get("one_host_turns") or {}).get("1", {})
    found = {
        f"two_over_one_{most}_sessions": (_over(_rate(report, "machines", "2", most),
                                                _rate(report, "machines", "1", most)), 1.85),
        "two_over_one_1_session": (_over(_rate(report, "machines", "2", 1), _rate(report, "machines", "1", 1)), 0.97),
        "one_host_split_over_full_1_session": ((turns.get("split_over_full") or {}).get("median"), 0.95),
        "one_machine_over_llama_cpp_1_session": (_over(_rate(report, "machines", "1", 1),
                                                       llama.get("decode_tok_s")), 1.0),
        "one_host_full_over_llama_cpp_1_session": ((turns.get("full_over_llama_cpp") or {}).get("median"), 1.0),
    }
    if "3" in report["machines"]:
        found[f"three_over_one_{most}_sessions"] = (_over(_rate(report, "machines", "3", most),
                                                          _rate(report, "machines", "1", most)), None)
    sequences = (llama.get("sessions") or {}).get(str(most))
    found[f"one_machine_over_llama_cpp_{most}_sequences"] = (
        _over(_rate(report, "machines", "1", most), sequences["aggregate_tok_s"] if sequences else None), 1.0)
    return {name: {"value": value, "target": target, "met": None if value is None or target is None
                   else value >= target} for name, (value, target) in found.items()}


def write_scale_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Aggregate tok/s against sessions: one line per machine count, the one-host split and llama.cpp."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(9.5, 4.2))
    lines = [(f"{name} machine{'s' if name != '1' else ''}", case["sessions"])
             for name, case in report["machines"].items()]
    lines += [(f"one host, {name}", case["sessions"]) for name, case in report["one_host"].items()]
    sequences = (report.get("llama_cpp") or {}).get("sessions")
    if sequences:
        lines.append(("llama.cpp on one machine, as many sequences (decode only)", sequences))
    for label, data in lines:
        counts = sorted(int(count) for count in data)
        axes.plot(counts, [data[str(count)]["aggregate_tok_s"] for count in counts], marker="o", label=label,
                  linestyle="--" if label.startswith(("one host", "llama")) else "-")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent sessions")
    axes.set_ylabel("aggregate tok/s")
    axes.set_title(f"{report['model']}: machines added (a core each), drafts off")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def run_scale_suite(args: argparse.Namespace, gguf: Path | None, out: Path) -> None:
    """`python -m meshws.bench --suite scale [--model FILE.gguf] [--sessions ...]`."""
    import json

    from .memory_bench import write_report

    report = run_scale(args.model, gguf, sorted(set(args.sessions)), args.tokens, args.runs)
    plot = write_scale_plot(report, out.with_suffix(".png"))
    report["plot"] = str(plot) if plot else None
    write_report({"model": report["model"], "scale": report}, out)
    print(json.dumps(report["ratios"], indent=1))
