"""The mesh secret: headers work once, for their path, within the clock skew; links and joins need it."""

import asyncio
import time

import aiohttp

from fakes import CachedHeadBackend, LoopTailBackend, wait_ready
from meshws.config import NodeSettings
from meshws.mesh.auth import HEADER, Verifier, sign
from meshws.node import Node


def test_verifier_accepts_a_fresh_header_once_and_refuses_the_rest():
    verifier = Verifier("s3cret")
    header = sign("s3cret", "/ws/shard")
    assert verifier.check(header, "/ws/shard") is None
    assert "replay" in verifier.check(header, "/ws/shard")
    assert "wrong mesh secret" in verifier.check(sign("guess", "/ws/shard"), "/ws/shard")
    assert "wrong mesh secret" in verifier.check(sign("s3cret", "/mesh/join"), "/ws/shard")  # bound to its path
    assert "missing" in verifier.check(None, "/ws/shard")
    assert "too old" in verifier.check(sign("s3cret", "/ws/shard", now=time.time() - 3600), "/ws/shard")
    assert "malformed" in verifier.check("not-a-header", "/ws/shard")
    assert Verifier(None).check(None, "/ws/shard") is None  # no secret set: open


async def test_links_and_joins_need_the_secret(caplog):
    tail = Node(NodeSettings(role="tail", port=0, layers=(6, 12), secret="right"), backend=LoopTailBackend())
    tail_port = await tail.start()
    wrong = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret="wrong"), backend=CachedHeadBackend())
    await wrong.start()
    try:
        await asyncio.sleep(1.0)
        link = wrong.links.all()[0]
        assert link.state != "up" and "401" in (link.last_error or "")
        assert not wrong.health()["ready"]
        assert tail.health()["inbound_links"] == 0
        assert "refused /ws/shard" in caplog.text
        async with aiohttp.ClientSession() as client:  # no header at all
            async with client.get(f"http://127.0.0.1:{tail_port}/ws/shard") as response:
                assert response.status == 401
    finally:
        await wrong.stop()
    right = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret="right"), backend=CachedHeadBackend())
    head_port = await right.start()
    try:
        await wait_ready(head_port)
        join = {"url": "ws://127.0.0.1:1", "node": "x", "model": "fake-model", "layers": [6, 12]}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join) as response:
                assert response.status == 401
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join,
                                   headers={HEADER: sign("wrong", "/mesh/join")}) as response:
                assert response.status == 401
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join,
                                   headers={HEADER: sign("right", "/mesh/join")}) as response:
                assert response.status == 200
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            async with client.post(f"http://127.0.0.1:{head_port}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        await right.stop()
        await tail.stop()
