"""Streams through a head's OpenAI API, timed: what the benchmarks measure with."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any


async def stream_once(url: str, model: str, prompt_ids: list[int], tokens: int, ssl: Any = True) -> dict[str, float]:
    import aiohttp

    body = {"model": model, "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    completion = 0
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
                    first = first or now
                    last = now
    if first is None or last is None or completion < 2:
        raise RuntimeError("the stream carried no tokens")
    return {"ttft_s": first - started, "decode_tok_s": (completion - 1) / max(last - first, 1e-9),
            "tokens": completion, "wall_s": last - started}


async def sessions_run(url: str, model: str, prompt_ids: list[int], tokens: int, count: int,
                       ssl: Any = True) -> dict[str, float]:
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream_once(url, model, prompt_ids, tokens, ssl) for _ in range(count)))
    wall = time.perf_counter() - started
    ttfts = sorted(run["ttft_s"] for run in runs)
    return {
        "sessions": count,
        "per_session_tok_s": round(statistics.mean(run["decode_tok_s"] for run in runs), 2),
        "aggregate_tok_s": round(sum(run["tokens"] for run in runs) / wall, 2),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
        "ttft_p95_s": round(ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))], 4),
    }
