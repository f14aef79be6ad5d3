"""Real processes under abuse: a live tail fed fuzzed frames, and 64 concurrent streams with aborts."""

import asyncio
import random
import struct
import time

import aiohttp
import orjson
import pytest
import torch

from meshws.mesh.wire import Hello, encode_control
from meshws.tools.launch import Mesh


def _frame(header, body):
    head = orjson.dumps(header)
    return struct.pack(">I", len(head)) + head + body


def _mutations(seed: int):
    rng = random.Random(seed)
    good = {"type": "fwd", "sid": "fz", "step": 1, "mode": "prefill", "past_len": 0, "shape": [1, 2, 576],
            "dtype": "bfloat16", "enc": None}
    frames = []
    for _ in range(25):
        kind = rng.randrange(6)
        if kind == 0:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))))
        elif kind == 1:
            data = bytearray(_frame(good, bytes(2304)))
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frames.append(bytes(data))
        elif kind == 2:
            header = dict(good, **{rng.choice(list(good)): rng.choice([None, -1, "x", [], {}, 10**12, 2.5])})
            frames.append(_frame(header, bytes(2304)))
        elif kind == 3:
            field = rng.choice(["type", "sid", "x"])
            frames.append(orjson.dumps({field: rng.choice(["open", "close", 5, None])}).decode())
        elif kind == 4:
            frames.append("".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 40))))
        else:
            frames.append(_frame(dict(good, shape=[1, rng.randrange(1, 4), 576]), bytes(rng.randrange(0, 5000))))
    return frames


@pytest.mark.real_model
@pytest.mark.processes
async def test_fuzzed_frames_on_a_live_tail_get_errors_and_generation_still_works(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")])
    try:
        async with aiohttp.ClientSession() as client:
            for seed in range(4):
                async with client.ws_connect(f"{mesh.tail.ws_url}/ws/shard") as ws:
                    await ws.send_str(encode_control(Hello("SmolLM2-135M-Instruct", (0, 15), "head", "fuzzer", 30)))
                    assert (await ws.receive_json())["type"] == "hello"
                    await ws.send_str('{"type": "open", "sid": "fz"}')
                    for frame in _mutations(seed):
                        await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
                    # A well-formed step after the noise: the link still serves it.
                    body = torch.randn(1, 2, 576).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
                    sentinel = f"sentinel-{seed}"
                    await ws.send_str(orjson.dumps({"type": "open", "sid": sentinel}).decode())
                    await ws.send_bytes(_frame({"type": "fwd", "sid": sentinel, "step": 9, "mode": "prefill",
                                                "past_len": 0, "shape": [1, 2, 576], "dtype": "bfloat16",
                                                "enc": None}, body))
                    errors = 0
                    while True:
                        reply = await asyncio.wait_for(ws.receive_json(), 30)
                        assert reply["type"] in ("error", "token", "cache_miss"), reply
                        errors += reply["type"] == "error"
                        if reply.get("sid") == sentinel:
                            assert reply["type"] == "token", reply
                            break
                    assert errors >= 10
        assert mesh.tail.wait_sessions(0)["sessions"] == 0  # the fuzzing links closed: all released
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        mesh.stop()


@pytest.mark.real_model
@pytest.mark.processes
async def test_load_64_streams_a_third_abort_everything_else_correct_and_nothing_leaks(embedded_model):
    # Default flags: 64 streams are twice --max-generations; the rest wait in the admission queue, none is refused.
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=("--dtype", "float32", "--wire-dtype", "float32"))
    prompts = ["Name a colour.", "Name an animal.", "Name a fruit.", "Name a country."]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            async def stream(prompt, abort_after=None):
                body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 12, "temperature": 0, "stream": True}
                parts, chunks = [], 0
                async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = orjson.loads(line[6:])
                        assert "error" not in chunk, chunk
                        chunks += 1
                        if chunk["choices"]:
                            parts.append(chunk["choices"][0]["delta"].get("content") or "")
                        if abort_after is not None and chunks >= abort_after:
                            response.close()  # the client goes away mid-stream
                            return None
                return "".join(parts)

            expected = {prompt: await stream(prompt) for prompt in prompts}
            rng = random.Random(7)
            plan = [(prompts[i % 4], rng.randrange(1, 8) if i % 3 == 0 else None) for i in range(64)]
            started = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(stream(p, a) for p, a in plan)), 420)
            elapsed = time.monotonic() - started
        finished = [(p, r) for (p, a), r in zip(plan, results) if a is None]
        assert len(finished) == 42
        assert all(result == expected[prompt] for prompt, result in finished)
        for node in mesh.nodes:
            health = node.wait_sessions(0, timeout=10)
            assert health["sessions"] == 0 and health["cache_bytes"] == 0, health
        head = mesh.head.health()
        assert head["generations"] == 0 and head["queued"] == 0 and head["max_generations"] < 64
        tail = mesh.tail.health()
        assert tail["channels"] == 0 and tail["pending_tasks"] == 0 and tail["inbound_links"] == 1
        print(f"64 streams (21 aborted) in {elapsed:.1f} s")
    finally:
        mesh.stop()
