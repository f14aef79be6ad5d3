"""`python -m meshws.bench --suite standby`: what a session loses when the tail serving it dies or drains (issue 64).

Real node processes: a head and two tails of the same layers that --join it (the embedded model, `--dtype float32`),
or for a GGUF a head, a middle and two tails (three parts). One streamed completion of a `--standby-prompt`-token
prompt (random token ids, so its length is exact), `--standby-tokens` greedy tokens, drafts off. For each case a
fresh mesh answers it once without a fault, then again with the serving tail hit at token 40:

  * kill: SIGKILL;  drain: SIGTERM with the tails' `--drain-timeout 1`;  off: SIGKILL under `--standby off`.

Reported: the fault-free time to first token; the largest gap between two tokens of the answer that was hit, and
it over that time to first token (target <= 0.35 with a standby; without one the gap is the re-prefill); whether
the text is the fault-free one; the positions run again (the head's /health); the bytes the serving tail sent its
standby during the fault-free answer against the KV that answer produced (target <= 1.2x); sessions and copies left
on every node after each answer (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..model.gguf.gguf_file import geometry, read_table
from .bench_kv import _ids, _model, kv_bytes_per_token
from .launch import NodeProcess, free_port
from .streams import completion_chunks

HIT_AT = 40  # the token after which the serving tail is hit


class Cluster:
    """A head and the nodes that join it; `parts` 2: head + two tails; 3: head + middle + two tails."""

    def __init__(self, model: str, total: int, parts: int, standby: str, dtype: str) -> None:
        common = ("--model", model, "--dtype", dtype, "--draft", "none", "--threads", "1")
        cuts = [round(total * k / parts) for k in range(parts + 1)]
        spans = [f"{cuts[k]}-{cuts[k + 1] - 1}" for k in range(parts)]
        port = free_port()
        self.nodes: list[NodeProcess] = []
        self.head = self._add(NodeProcess("--role", "head", "--layers", spans[0], *common, "--standby", standby,
                                          "--registry-ttl", "4", name="head", port=port))
        joined = ("--join", f"http://127.0.0.1:{port}", "--drain-timeout", "1", *common)
        if parts == 3:
            self._add(NodeProcess("--role", "middle", "--layers", spans[1], *joined, name="middle"))
        self.tails = [self._add(NodeProcess("--role", "tail", "--layers", spans[-1], *joined, name=f"tail{n}"))
                      for n in range(2)]
        for node in self.nodes:
            node.wait_started(300)
        deadline = time.monotonic() + 120
        while len(self.head.health().get("nodes", [])) < len(self.nodes) - 1 or not self.head.health()["ready"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the mesh did not form: {self.head.health().get('problems')}")
            time.sleep(0.2)

    def _add(self, node: NodeProcess) -> NodeProcess:
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


async def _answer(url: str, model: str, ids: list[int], tokens: int, on_token: Any = None) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times, text = [], []
    async for at, chunk in completion_chunks(url, body):
        if chunk.get("choices"):
            times.append(at)
            text.append(chunk["choices"][0]["text"])
            if on_token is not None:
                await on_token(len(times))
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"text": "".join(text), "ttft_s": times[0], "max_gap_s": max(gaps, default=0.0)}


def _kv_out_bytes(node: NodeProcess) -> float:
    with urllib.request.urlopen(f"{node.url}/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith('meshws_frame_bytes_total{direction="out",type="kv"}'):
                return float(line.split()[-1])
    return 0.0


def _left(nodes: list[NodeProcess]) -> int:
    """Sessions and standby copies left on the nodes still running, once they settle (a few seconds at most)."""
    deadline = time.monotonic() + 10
    while True:
        left = sum(health["sessions"] + health.get("standbys", 0) for health in
                   (node.health() for node in nodes if node.proc.poll() is None))
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def case(model: str, gguf: Path, fault: str, prompt: int, tokens: int) -> dict[str, Any]:
    """One fault on a fresh mesh: the embedded model in two parts at float32, another GGUF in three parts."""
    layers = geometry(read_table(gguf))[0]
    embedded = model in ("embedded", "")
    parts, dtype = (2, "float32") if embedded else (3, "auto")
    cluster = Cluster(model, layers, parts, "off" if fault == "off" else "auto", dtype)
    try:
        name, ids = _model(cluster.head), _ids(prompt, random.Random(5))
        clean = asyncio.run(_answer(cluster.head.url, name, ids, tokens))
        sent = max(_kv_out_bytes(tail) for tail in cluster.tails)  # (what the serving one sent its standby)
        left_clean = _left(cluster.nodes)
        tail_layers = layers - round(layers * (parts - 1) / parts)
        per_token = kv_bytes_per_token(str(gguf), tail_layers, "float32" if dtype == "float32" else "bfloat16")
        hit: list[NodeProcess] = []

        async def strike(count: int) -> None:
            if count == HIT_AT and not hit:
                healths = await asyncio.gather(*(asyncio.to_thread(tail.health) for tail in cluster.tails))
                tail = next(t for t, h in zip(cluster.tails, healths) if h["sessions"] == 1)
                tail.proc.send_signal(signal.SIGTERM if fault == "drain" else signal.SIGKILL)
                hit.append(tail)

        faulty = asyncio.run(_answer(cluster.head.url, name, ids, tokens, strike))
        time.sleep(0.5)
        failovers = cluster.head.health().get("failovers", {})
        result = {
            "fault": fault, "prompt_tokens": prompt, "tokens": tokens, "ttft_s": round(clean["ttft_s"], 3),
            "max_gap_s": round(faulty["max_gap_s"], 3),
            "gap_over_ttft": round(faulty["max_gap_s"] / clean["ttft_s"], 3),
            "same_text": faulty["text"] == clean["text"], "failovers": failovers,
            "left_after": left_clean + _left(cluster.nodes),
        }
        if fault != "off":
            produced = (prompt + tokens) * per_token
            result.update(standby_bytes=int(sent), kv_bytes=int(produced), bytes_over_kv=round(sent / produced, 3))
        return result
    finally:
        cluster.stop()


def add_standby_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--standby-prompt", type=int, default=3000, help="standby: tokens of the prompt")
    parser.add_argument("--standby-tokens", type=int, default=160, help="standby: tokens of the answer")


def run_standby_suite(args: argparse.Namespace, gguf: Path | None, out: Path) -> None:
    """The standby suite on its own: `python -m meshws.bench --suite standby [--model FILE.gguf]`."""
    from .memory_bench import write_report

    if gguf is None:
        raise SystemExit("--suite standby runs the embedded model or a GGUF file (--model)")
    cases = []
    for fault in ("kill", "drain", "off"):
        cases.append(case(args.model, gguf, fault, args.standby_prompt, args.standby_tokens))
        print(json.dumps(cases[-1]), flush=True)
    write_report({"model": gguf.stem, "standby": cases}, out)
