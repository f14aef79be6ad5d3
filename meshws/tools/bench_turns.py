"""The benchmark's conversation scenario: does turn N start as fast as turn 1?

A six-turn conversation with a ~500-token system prompt runs twice through one head +
tail mesh started with `--warm-sessions`: once reusing the session (one `/ws/chat`
socket for every turn; over the OpenAI API, the warm pool), once without (a new socket
per turn; `cache_prompt: false`). Greedy decoding makes both see the same messages; the
figure is the mean time to first token of turns 2-6 with reuse over the same without.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Awaitable, Callable

SYSTEM = " ".join(
    f"Rule {n}: when the customer asks about part number {100 + n}, explain its purpose, how it is fitted, and which "
    f"tool is needed, in plain words and without prices." for n in range(1, 14))
QUESTIONS = ["Hello! What can you help me with?", "What does part 101 do?", "How is it fitted?",
             "Which tool do I need for part 102?", "Can you summarise what we discussed?", "Thank you, goodbye."]

Turn = Callable[[list[dict[str, str]]], Awaitable[tuple[str, float, int]]]  # -> (text, seconds to first text, cached)


async def _ws_turns(url: str, reuse: bool, conversations: list[list[dict[str, str]]] | None, tokens: int,
                    turns: int) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as client:
        socket = await client.ws_connect(f"{url}/ws/chat") if reuse else None

        async def turn(messages: list[dict[str, str]]) -> tuple[str, float, int]:
            ws = socket or await client.ws_connect(f"{url}/ws/chat")
            try:
                started, first = time.perf_counter(), None
                await ws.send_json({"type": "chat", "messages": messages, "max_tokens": tokens, "temperature": 0})
                while True:
                    message = await ws.receive_json(timeout=600)
                    if message["type"] == "delta" and first is None:
                        first = time.perf_counter() - started
                    elif message["type"] == "done":
                        return message["text"], first if first is not None else time.perf_counter() - started, \
                            message["cached_tokens"]
                    elif message["type"] == "error":
                        raise RuntimeError(message["message"])
            finally:
                if socket is None:
                    await ws.close()

        try:
            return await _converse(turn, conversations, turns)
        finally:
            if socket is not None:
                await socket.close()


async def _api_turns(url: str, model: str, reuse: bool, conversations: list[list[dict[str, str]]] | None,
                     tokens: int, turns: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def turn(messages: list[dict[str, str]]) -> tuple[str, float, int]:
        started, first, parts, cached = time.perf_counter(), None, [], 0
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body={"cache_prompt": reuse})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        return "".join(parts), first if first is not None else time.perf_counter() - started, cached

    try:
        return await _converse(turn, conversations, turns)
    finally:
        await client.close()


async def _converse(turn: Turn, conversations: list[list[dict[str, str]]] | None, turns: int) -> dict[str, Any]:
    """The turns of one conversation (or, given `conversations`, exactly those prompts again)."""
    prompts, ttft, cached = [], [], []
    messages = [{"role": "system", "content": SYSTEM}]
    for index in range(turns):
        if conversations is not None:
            messages = conversations[index]
        else:
            messages = messages + [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
        text, first, reused = await turn(messages)
        prompts.append(messages)
        ttft.append(first)
        cached.append(reused)
        messages = messages + [{"role": "assistant", "content": text}]
    return {"prompts": prompts, "ttft_s": [round(t, 4) for t in ttft], "cached_tokens": cached}


async def measure_turns(url: str, model: str, tokens: int, turns: int) -> dict[str, Any]:
    """TTFT per turn with and without reuse, over /ws/chat and over the OpenAI API (the warm pool)."""
    result: dict[str, Any] = {"turns": turns}
    for name in ("ws_chat", "openai_api"):
        async def run(reuse: bool, prompts: list | None) -> dict[str, Any]:
            if name == "ws_chat":
                return await _ws_turns(url, reuse, prompts, tokens, turns)
            return await _api_turns(url, model, reuse, prompts, tokens, turns)

        warm = await run(True, None)
        cold = await run(False, warm["prompts"])  # the very same prompts, each prefilled in full
        later_warm, later_cold = statistics.mean(warm["ttft_s"][1:]), statistics.mean(cold["ttft_s"][1:])
        result[name] = {"ttft_reuse_s": warm["ttft_s"], "ttft_fresh_s": cold["ttft_s"],
                        "cached_tokens": warm["cached_tokens"], "prompt_chars": [len(str(p)) for p in warm["prompts"]],
                        "later_turns_ttft_ratio": round(later_warm / later_cold, 3)}
    return result


def measure_conversation(model: str, layers: int, dtype: str, model_id: str, tokens: int, turns: int) -> dict[str, Any]:
    """A head + tail started as a user would, with a warm pool; the conversation scenario through it (shared prompt
    prefixes off: turn 1 would find the prefix the fresh runs built, and the figure is the warm pool's)."""
    import asyncio

    from .launch import Mesh

    split = layers // 2
    mesh = Mesh([("head", f"0-{split - 1}"), ("tail", f"{split}-{layers - 1}")],
                common=("--model", model, "--dtype", dtype),
                extra={"head": ("--warm-sessions", "4", "--shared-prefixes", "0")},
                split_threads=False)
    try:
        return asyncio.run(measure_turns(mesh.head.url, model_id, tokens, turns))
    finally:
        mesh.stop()
