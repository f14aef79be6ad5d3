"""Real node processes over real websockets on the embedded model (issue: websocket mesh)."""

import asyncio
import os
import time

import aiohttp
import orjson
import pytest
import torch

from helpers import CHAT_PROMPTS, EXACT, MODEL, chat_ids, complete_ids, golden
from meshws.mesh.wire import Hello, encode_control
from meshws.model.source import embedded_gguf_path as MODEL_PATH
from meshws.tools.launch import Mesh, NodeProcess

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


async def test_head_and_tail_processes_match_in_process_generate(mesh, tokenizer, reference_model):
    for prompt in CHAT_PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        tokens, text = await complete_ids(mesh.head.url, ids, 32)
        assert tokens == golden(reference_model, ids, 32)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert mesh.head.wait_sessions(0)["sessions"] == 0
    assert mesh.tail.wait_sessions(0)["sessions"] == 0


async def test_health_and_metrics_describe_the_node(mesh):
    head, tail = mesh.head.health(), mesh.tail.health()
    assert head["role"] == "head" and head["layers"] == [0, 15] and head["model"] == MODEL
    assert tail["role"] == "tail" and tail["layers"] == [15, 30] and tail["ready"]
    assert head["links"][0]["state"] == "up" and head["links"][0]["layers"] == [15, 30]
    assert [hop["layers"] for hop in head["chain"]] == [[0, 15], [15, 30]]
    # Each maps its 15 layers' Q4_1 tensors and the Q8_0 embeddings (the tail's LM head) from the GGUF: 30 MB of
    # layers and 30 MB of embeddings, no copy; resident: what the prompts read (a head's embeddings only at the
    # prompts' rows).
    table = __import__("meshws.model.gguf.gguf_file", fromlist=["read_table"]).read_table(MODEL_PATH())
    for node, first, last in ((head, 0, 15), (tail, 15, 30)):
        mine = {name for name in table.tensors if name.startswith("blk.") and first <= int(name.split(".")[1]) < last}
        mine |= {"token_embd.weight"} | ({"output_norm.weight"} if last == 30 else set())
        assert node["weight_bytes"] == sum(table.tensors[name].nbytes for name in mine)
        weights = node["weights"]
        assert weights["mapped_bytes"] == node["weight_bytes"] and weights["source"].startswith("GGUF")
        assert set(weights["block_types"]) == {"F32", "Q4_1", "Q8_0"}
        # (+ 8 MiB: a page fault maps up to 64 KiB of the page cache around it, and SmolLM2's file keeps its tensors
        # in name order, so blk.2 lies beside blk.19 and blk.20: cached neighbours of a node's own pages get mapped)
        assert 0 < weights["resident_bytes"] <= weights["mapped_bytes"] + 2**23
        assert node["peak_resident_bytes"] >= node["resident_bytes"] > 0
        # the loaded model, tokenizer and libraries are frozen out of the collector (a full pass over them: 158 ms)
        assert node["heap"]["frozen_objects"] > 100_000, node["heap"]
        assert len(node["heap"]["collections"]) == len(node["heap"]["collection_seconds"]) == 3
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{mesh.tail.url}/metrics") as response:
            text = await response.text()
    for name in ("meshws_sessions ", "meshws_cache_bytes ", "meshws_steps_total{mode=\"decode\"}",
                 "meshws_step_seconds_bucket", 'meshws_frame_bytes_total{direction="in",type="fwd_decode"}',
                 "meshws_weight_bytes ", "meshws_peak_resident_bytes ", "process_resident_memory_bytes ",
                 "meshws_weight_mapped_bytes ", "meshws_weight_resident_bytes ",
                 'meshws_weight_type_bytes{type="Q4_1"}'):
        assert name in text, name


async def test_client_abort_mid_stream_releases_every_cache(mesh, tokenizer):
    body = {"model": MODEL, "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}], "max_tokens": 300,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
            chunks = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                if chunks == 5:
                    assert mesh.tail.health()["sessions"] == 1
                    break
    # The client is gone: the head closes the channel, and every shard drops the cache.
    assert mesh.head.wait_sessions(0)["sessions"] == 0
    tail = mesh.tail.wait_sessions(0)
    assert tail["sessions"] == 0 and tail["cache_bytes"] == 0


async def test_malformed_frames_get_error_frames_and_the_link_goes_on(embedded_model):
    tail = NodeProcess("--role", "tail", "--layers", "15-29", "--max-frame-bytes", "256K", name="tail").wait_started()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(f"{tail.ws_url}/ws/shard") as ws:
                await ws.send_str(encode_control(Hello(MODEL, (0, 15), "head", "test", 30)))
                assert (await ws.receive_json())["type"] == "hello"

                async def error_for(send) -> str:
                    await send
                    reply = await asyncio.wait_for(ws.receive_json(), 10)
                    assert reply["type"] == "error", reply
                    return reply["message"]

                assert "not JSON" in await error_for(ws.send_str("{nope"))
                assert "unknown frame type" in await error_for(ws.send_str('{"type": "explode", "sid": "x"}'))
                assert "shorter" in await error_for(ws.send_bytes(b"\x00"))
                header = {"type": "fwd", "sid": "s1", "step": 1, "mode": "prefill", "past_len": 0,
                          "shape": [1, 3, 576], "dtype": "bfloat16", "enc": None}
                frame = lambda h, body: len(orjson.dumps(h)).to_bytes(4, "big") + orjson.dumps(h) + body  # noqa: E731
                assert "unknown session" in await error_for(ws.send_bytes(frame(header, b"\x00" * 3456)))
                await ws.send_str('{"type": "open", "sid": "s1"}')
                assert "needs 3456" in await error_for(ws.send_bytes(frame(header, b"\x00" * 100)))
                wrong = dict(header, shape=[1, 3, 500])
                assert "576" in await error_for(ws.send_bytes(frame(wrong, b"\x00" * 3000)))
                big = dict(header, shape=[1, 300, 576])
                assert "exceeds the limit" in await error_for(ws.send_bytes(frame(big, os.urandom(345600))))
                # The same link still serves the session: a well-formed prefill gets a token.
                body = torch.randn(1, 3, 576).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
                await ws.send_bytes(frame(header, body))
                reply = await asyncio.wait_for(ws.receive_json(), 20)
                assert reply["type"] == "token" and isinstance(reply["token_id"], int) and reply["step"] == 1
                assert tail.health()["sessions"] == 1
                await ws.send_str('{"type": "close", "sid": "s1"}')
                assert tail.wait_sessions(0)["sessions"] == 0
            # A hello for another model is refused with the reason.
            async with client.ws_connect(f"{tail.ws_url}/ws/shard") as ws:
                await ws.send_str(encode_control(Hello("other", (0, 15), "head", "t", 30)))
                reply = await ws.receive_json()
                assert reply["type"] == "error" and "other" in reply["message"]
                assert (await ws.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert tail.health()["status"] == "ok"
    finally:
        tail.stop()


async def test_three_node_chain_matches_generate_and_a_cut_link_releases_caches(tokenizer, reference_model):
    mesh = Mesh([("head", "0-9"), ("middle", "10-19"), ("tail", "20-29")], common=EXACT)
    try:
        assert [hop["layers"] for hop in mesh.head.health()["chain"]] == [[0, 10], [10, 20], [20, 30]]
        ids = chat_ids(tokenizer, CHAT_PROMPTS[1])
        tokens, _ = await complete_ids(mesh.head.url, ids, 24)
        assert tokens == golden(reference_model, ids, 24)
        for node in mesh.nodes:
            assert node.wait_sessions(0)["sessions"] == 0

        body = {"model": MODEL, "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}], "max_tokens": 400,
                "temperature": 0, "stream": True}
        events = []
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    events.append(line[6:].strip())
                    if len(events) == 4:
                        assert mesh.tail.health()["sessions"] == 1
                        mesh.nodes[1].kill()  # the middle dies: both of its links drop
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["type"] == "upstream_error" and "lost" in error["message"]
        assert mesh.tail.wait_sessions(0)["sessions"] == 0
        assert mesh.head.wait_sessions(0)["sessions"] == 0
        assert not mesh.head.health()["ready"]
    finally:
        mesh.stop()


async def test_tail_with_one_cache_slot_serves_three_concurrent_generations(tokenizer):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT, extra={"tail": ("--max-sessions", "1")})
    try:
        prompts = [chat_ids(tokenizer, text) for text in CHAT_PROMPTS]
        alone = [await complete_ids(mesh.head.url, ids, 20) for ids in prompts]
        together = await asyncio.gather(*(complete_ids(mesh.head.url, ids, 20) for ids in prompts))
        assert list(together) == alone
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{mesh.tail.url}/metrics") as response:
                metrics = await response.text()
        misses = next(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("meshws_cache_misses_total "))
        assert misses > 0, "three sessions on one cache slot must have evicted each other"
        assert mesh.tail.wait_sessions(0)["sessions"] == 0
    finally:
        mesh.stop()


def test_node_stops_cleanly_on_sigterm(embedded_model):
    node = NodeProcess("--role", "tail", "--layers", "15-29", name="tail").wait_started()
    assert node.stop() == 0
    assert any("shutting down" in line for line in node.lines)


async def test_under_load_head_and_tail_compute_at_the_same_time(mesh, tokenizer):
    """Eight sessions on a head + tail: the head keeps two groups in flight, so it computes one group's
    step while the tail computes the other's (the shards' recent-step records overlap in time)."""
    ids = chat_ids(tokenizer, "Count from one to fifty, one number per line.")
    started = time.monotonic()
    await asyncio.gather(*(complete_ids(mesh.head.url, ids, 24, ignore_eos=True) for _ in range(8)))
    head = [step for step in mesh.head.health()["compute"]["recent_steps"] if step[0] >= started]
    tail = [step for step in mesh.tail.health()["compute"]["recent_steps"] if step[0] >= started]
    assert max(rows for _, _, rows in head) == 4, head  # eight live sessions, two groups of four
    overlap = sum(max(0.0, min(a_end, b_end) - max(a_start, b_start))
                  for a_start, a_end, _ in head for b_start, b_end, _ in tail)
    tail_busy = sum(end - start for start, end, _ in tail)
    assert overlap > 0.4 * tail_busy, (overlap, tail_busy)  # measured 0.71 (0.48 with one group)
