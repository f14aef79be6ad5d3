"""The benchmark's speculative-decoding scenario: tokens per lap and time per token, drafts against none.

One tail and four heads on it: two reach it through a relay that delays every byte by
25 ms each way (a long link; `--link-delay UP DOWN` sets each direction), two directly (loopback); of each pair one
guesses (`--draft ngram`) and one does not (`--draft none`). Each head answers a prompt that
asks to repeat a text and an ordinary one, greedy, up to a number of tokens or the end
of the answer (past it, the model's text no longer repeats anything). Laps are
the decode frames that reach the tail; time per token is the stream's decode time over
its tokens after the first.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

from .streams import stream_once

DELAY = (0.025, 0.025)  # seconds head -> tail, tail -> head
QUOTE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
         "spiral stairs, trimmed the wick, polished the lens and watched the ships pass safely into the harbour.")
PROMPTS = {"repeat": f"Repeat the following text exactly, word for word:\n\n{QUOTE}",
           "ordinary": "Write a short story about a robot who learns to paint."}


def _decode_frames(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith('meshws_frames_total{direction="in",type="fwd_decode"}'):
            return float(line.split()[-1])
    return 0.0


def measure_laps(model: str, layers: int, dtype: str, model_id: str, tokens: int, tokenizer: Any,
                 links: tuple[str, ...] = ("delayed", "loopback"),
                 delay: tuple[float, float] = DELAY) -> dict[str, Any]:
    from .launch import NodeProcess
    from .relay import RelayThread

    split = layers // 2
    common = ("--model", model, "--dtype", dtype)
    tail = NodeProcess("--role", "tail", "--layers", f"{split}-{layers - 1}", *common, name="tail").wait_started()
    relay = RelayThread(tail.port, delay[0], delay_back=delay[1])
    heads: dict[tuple[str, str], Any] = {}
    try:
        for link, port in (("delayed", relay.port), ("loopback", tail.port)):
            if link not in links:
                continue
            for draft in ("ngram", "none"):
                heads[(link, draft)] = NodeProcess("--role", "head", "--layers", f"0-{split - 1}", *common, "--draft",
                                                   draft, "--peer", f"ws://127.0.0.1:{port}", name=f"head {draft}")
        for head in heads.values():
            head.wait_started()
            head.wait_ready(60)
        result: dict[str, Any] = {"delay_s": {"to_tail": delay[0], "to_head": delay[1]}, "tokens": tokens}
        for (link, draft), head in heads.items():
            for name, prompt in PROMPTS.items():
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
                asyncio.run(stream_once(head.url, model_id, ids, 4))  # warm-up
                before = _decode_frames(tail.url)
                run = asyncio.run(stream_once(head.url, model_id, ids, tokens, ignore_eos=False))
                laps = _decode_frames(tail.url) - before
                result[f"{link}_{name}_{draft}"] = {
                    "token_s": round(1 / run["decode_tok_s"], 5), "laps": laps,
                    "tokens_per_lap": round((run["tokens"] - 1) / laps, 3) if laps else None}
        for link in links:
            for name in PROMPTS:
                drafted, plain = result[f"{link}_{name}_ngram"], result[f"{link}_{name}_none"]
                result[f"{link}_{name}_time_ratio"] = round(drafted["token_s"] / plain["token_s"], 3)
        return result
    finally:
        for head in heads.values():
            head.stop()
        relay.stop()
        tail.stop()


def summary(result: dict[str, Any]) -> str:
    return json.dumps({key: value for key, value in result.items() if key.endswith("ratio")})
