"""Fuzzed hellos on a live /ws/shard: each gets an error frame and a closed link; the node keeps serving."""

import json

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import CachedHeadBackend, CachedTailBackend, fake_mesh

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
hellos = st.fixed_dictionaries({"type": st.just("hello")}, optional={
    key: values for key in ("version", "model", "layers", "role", "node", "total_layers", "chain")})


async def test_fuzzed_hellos_are_refused_with_a_reason_and_the_node_serves_on():
    frames = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(hellos.map(json.dumps), st.text(max_size=40)))
    def collect(frame):
        frames.append(frame)

    collect()
    tail = CachedTailBackend([(" a", 1), ("", 99)])
    async with fake_mesh(CachedHeadBackend(), tail) as mesh:
        async with aiohttp.ClientSession() as client:
            for frame in frames:
                async with client.ws_connect(f"ws://127.0.0.1:{mesh.tail_port}/ws/shard") as ws:
                    await ws.send_str(frame)
                    reply = await ws.receive_json(timeout=5)
                    assert reply["type"] == "error" and reply["message"].startswith("link refused"), (frame, reply)
            assert mesh.tail.health()["inbound_links"] == 1  # only the head's link
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with client.post(f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions", json=body) as response:
                assert response.status == 200
