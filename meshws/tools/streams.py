"""Streams through a head's OpenAI API, timed: what the benchmarks measure with."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any, AsyncIterator


async def completion_chunks(url: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """A streamed `/v1/completions` answer's chunks, each with the seconds since the request began; an error
    chunk raises."""
    import aiohttp

    began = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as client:
        async with client.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                yield time.perf_counter() - began, chunk


async def stream_once(url: str, model: str, prompt_ids: list[int], tokens: int, ssl: Any = True,
                      first_token: asyncio.Event | None = None, ignore_eos: bool = True) -> dict[str, Any]:
    import aiohttp

    body = {"model": model, "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    completion = 0
    gaps: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        async with client.post(f"{url}/v1/completions", json=body, ssl=ssl) as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    completion = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    elif first_token is not None:
                        first_token.set()
                    first = first or now
                    last = now
    if first is None or last is None or completion < 2:
        raise RuntimeError("the stream carried no tokens")
    return {"ttft_s": first - started, "decode_tok_s": (completion - 1) / max(last - first, 1e-9),
            "tokens": completion, "wall_s": last - started, "gaps": gaps}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))] if ordered else 0.0


async def sessions_run(url: str, model: str, prompt_ids: list[int], tokens: int, count: int,
                       ssl: Any = True) -> dict[str, float]:
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream_once(url, model, prompt_ids, tokens, ssl) for _ in range(count)))
    wall = time.perf_counter() - started
    ttfts = [run["ttft_s"] for run in runs]
    gaps = [gap for run in runs for gap in run["gaps"]]
    return {
        "sessions": count,
        "per_session_tok_s": round(statistics.mean(run["decode_tok_s"] for run in runs), 2),
        "aggregate_tok_s": round(sum(run["tokens"] for run in runs) / wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p95_s": round(percentile(ttfts, 0.95), 4),
        "itl_p50_s": round(percentile(gaps, 0.5), 4),  # inter-token latency: gaps between a stream's tokens
        "itl_p95_s": round(percentile(gaps, 0.95), 4),
        "wall_s": round(wall, 3),
    }


async def median_run(url: str, model: str, prompt_ids: list[int], tokens: int, count: int, runs: int,
                     ssl: Any = True) -> dict[str, Any]:
    """`sessions_run` `runs` times: each figure the median of its runs (one 16-session run swung by a tenth on a
    2-core machine from one run to the next), and every run's aggregate tok/s beside them."""
    found = [await sessions_run(url, model, prompt_ids, tokens, count, ssl) for _ in range(max(1, runs))]
    entry: dict[str, Any] = {key: round(statistics.median(run[key] for run in found), 4) for key in found[0]}
    entry["sessions"] = count
    entry["runs_aggregate_tok_s"] = [run["aggregate_tok_s"] for run in found]
    entry["runs_wall_s"] = [run["wall_s"] for run in found]
    return entry


async def joining_run(url: str, model: str, prompt_ids: list[int], tokens: int, busy: int,
                      ssl: Any = True) -> dict[str, float]:
    """A session that joins `busy` running ones once they all decode: its time to first token."""
    firsts = [asyncio.Event() for _ in range(busy)]
    running = [asyncio.ensure_future(stream_once(url, model, prompt_ids, tokens, ssl, first)) for first in firsts]
    await asyncio.gather(*(first.wait() for first in firsts))
    joiner = await stream_once(url, model, prompt_ids, 4, ssl)
    await asyncio.gather(*running)
    return {"busy_sessions": busy, "ttft_s": round(joiner["ttft_s"], 4)}
