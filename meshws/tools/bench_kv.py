"""`python -m meshws.bench --suite kv`: what KV caches cost a node, and what shared prompt prefixes save (issue 63).

Real node processes on the GGUF given (a synthetic 1B by default in the docs), prompts of random token ids
sent to `/v1/completions` (so their lengths are exact), greedy, drafts off:

  * memory: a full node serves `--kv-sessions` concurrent distinct prompts of `--kv-prompt` tokens; its
    resident memory's growth over what it held before (sampled every 50 ms) against their KV (the most
    `/health` counted at once), for each `--kv-dtype` asked;
  * prefixes: a head and a tail (a core each); 8 clients send the same `--kv-prompt`-token system prompt with
    different 50-token questions one after another: each one's time to first token and `cached_tokens`;
    then 8 more at once: the tail's growth against one prefix's KV and the questions'.

Targets: growth <= 1.15x the KV + 200 MB; time to first token of requests 2-8 <= 0.2x the first's,
`cached_tokens` >= 1,250 of 1,500; 8 at once grow the tail by <= 1.3x (prefix + questions' KV) + 150 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import urllib.request
from pathlib import Path
from typing import Any

from ..model.gguf.gguf_file import geometry, read_table
from .launch import Mesh, NodeProcess
from .streams import completion_chunks

QUESTION = 50
ANSWER = 16


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The most resident memory a process held, and the most KV bytes its /health counted, while running."""

    def __init__(self, node: NodeProcess) -> None:
        self.node, self.rss, self.kv = node, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "Peak":
        self.base = _rss(self.node.proc.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self.rss = max(self.rss, _rss(self.node.proc.pid))
            try:
                self.kv = max(self.kv, int(self.node.health().get("cache_bytes") or 0))
            except Exception:  # (a busy node may miss a sample)
                pass

    @property
    def growth(self) -> int:
        return max(0, self.rss - self.base)


async def _complete(url: str, model: str, ids: list[int]) -> dict[str, Any]:
    """One streamed completion: seconds to the first token, and its usage."""
    body = {"model": model, "prompt": ids, "max_tokens": ANSWER, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    first, usage = None, {}
    async for at, chunk in completion_chunks(url, body):
        if chunk.get("choices") and first is None:
            first = at
        usage = chunk.get("usage") or usage
    return {"ttft_s": first, "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _ids(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(count)]  # (within any of the synthetic files' vocabularies)


def _model(node: NodeProcess) -> str:
    with urllib.request.urlopen(f"{node.url}/v1/models") as response:
        return json.load(response)["data"][0]["id"]


def kv_bytes_per_token(gguf: str, layers: int, kv_dtype: str) -> float:
    """KV bytes one position holds in `layers` of the file's layers."""
    _, hidden, heads, kv_heads = geometry(read_table(Path(gguf)))
    return layers * 2 * kv_heads * (hidden // heads) * {"q8_0": 34 / 32, "float32": 4}.get(kv_dtype, 2)


def memory(gguf: str, kv_dtype: str, sessions: int, prompt: int) -> dict[str, Any]:
    node = NodeProcess("--role", "full", "--model", gguf, "--draft", "none", "--shared-prefixes", "0",
                       "--max-generations", str(sessions), "--kv-dtype", kv_dtype, name="full")
    try:
        node.wait_started(300)
        node.wait_ready(300)
        model = _model(node)
        rng = random.Random(1)

        async def run() -> list[dict[str, Any]]:
            await _complete(node.url, model, _ids(64, rng))  # warm: kernels, first buffers
            await asyncio.sleep(1.0)
            with Peak(node) as peak:
                results = await asyncio.gather(*(_complete(node.url, model, _ids(prompt, rng))
                                                 for _ in range(sessions)))
            return [peak.growth, peak.kv, results]

        growth, kv, _ = asyncio.run(run())
    finally:
        node.stop()
    mb = 2**20
    return {"kv_dtype": kv_dtype, "sessions": sessions, "prompt_tokens": prompt, "growth_mb": round(growth / mb, 1),
            "kv_mb": round(kv / mb, 1), "ratio": round(growth / kv, 3) if kv else None,
            "target_mb": round((1.15 * kv + 200 * mb) / mb, 1), "met": growth <= 1.15 * kv + 200 * mb,
            "kv_per_token": kv_bytes_per_token(gguf, geometry(read_table(Path(gguf)))[0], kv_dtype)}


def prefixes(gguf: str, prompt: int, clients: int = 8) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    layers = geometry(read_table(Path(gguf)))[0]
    half = layers // 2
    mesh = Mesh([("head", f"0-{half - 1}"), ("tail", f"{half}-{layers - 1}")],
                common=("--model", gguf, "--draft", "none"), extra={"head": ("--shared-prefixes", "16")},
                cpus=["0", "1"] if cores >= 2 else None, timeout=300)
    try:
        model = _model(mesh.head)
        rng = random.Random(2)
        system = _ids(prompt, rng)

        async def run() -> dict[str, Any]:
            one_by_one = [await _complete(mesh.head.url, model, system + _ids(QUESTION, rng)) for _ in range(clients)]
            await asyncio.sleep(1.0)
            with Peak(mesh.tail) as peak:
                await asyncio.gather(*(_complete(mesh.head.url, model, system + _ids(QUESTION, rng))
                                       for _ in range(clients)))
            return {"one_by_one": one_by_one, "growth": peak.growth}

        found = asyncio.run(run())
    finally:
        mesh.stop()
    first, later = found["one_by_one"][0], found["one_by_one"][1:]
    per_token = kv_bytes_per_token(gguf, layers - half, "bfloat16")
    allowed = 1.3 * per_token * (prompt + clients * (QUESTION + ANSWER)) + 150 * 2**20
    worst = max(r["ttft_s"] for r in later)
    return {"prompt_tokens": prompt, "first_ttft_s": round(first["ttft_s"], 3),
            "later_ttft_s": [round(r["ttft_s"], 3) for r in later], "worst_ratio": round(worst / first["ttft_s"], 3),
            "cached_tokens": [r["cached_tokens"] for r in found["one_by_one"]],
            "together_growth_mb": round(found["growth"] / 2**20, 1), "allowed_mb": round(allowed / 2**20, 1),
            "met": worst <= 0.2 * first["ttft_s"] and min(r["cached_tokens"] for r in later) >= 1250 * prompt // 1500
            and found["growth"] <= allowed}


def run(gguf: str, kv_dtypes: list[str], sessions: int, prompt: int) -> dict[str, Any]:
    found: dict[str, Any] = {"memory": [memory(gguf, kv_dtype, sessions, prompt) for kv_dtype in kv_dtypes]}
    found["prefixes"] = prefixes(gguf, prompt)
    return found


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", nargs="+", default=["bfloat16", "q8_0"], help="kv: the KV dtypes measured")
    parser.add_argument("--kv-sessions", type=int, default=16, help="kv: concurrent distinct prompts")
    parser.add_argument("--kv-prompt", type=int, default=1500, help="kv: tokens of each prompt (and system prompt)")


def run_kv_suite(args: argparse.Namespace, gguf: Path | None, out: Path) -> None:
    """The kv suite on its own: `python -m meshws.bench --suite kv --model FILE.gguf`."""
    from .memory_bench import write_report

    if gguf is None:
        raise SystemExit("--suite kv measures a GGUF file (--model)")
    section = run(str(gguf), args.kv_dtype, args.kv_sessions, args.kv_prompt)
    write_report({"model": gguf.stem, "kv": section}, out)
    print(json.dumps(section, indent=1))
