"""A head's drain on fake shards: waiting requests are refused, a generation that outlasts
--drain-timeout is closed (its session released on the shards), and the node stops."""

import asyncio
import time

import aiohttp

from fakes import CachedHeadBackend, eventually, fake_mesh
from test_slow_clients import EndlessTail


class SlowEndlessTail(EndlessTail):
    """' a' for ever, a millisecond a token: 2000 of them outlast the drain on any machine (instant, they did not)."""

    def answer(self, past_len):
        time.sleep(0.001)
        return super().answer(past_len)


async def test_a_drain_refuses_the_queue_and_closes_what_outlasts_the_drain_timeout():
    tail = SlowEndlessTail()
    async with fake_mesh(CachedHeadBackend(), tail, max_generations=1, drain_timeout=0.5) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                "stream": True}
        async with aiohttp.ClientSession() as client:
            async def stream():
                async with client.post(url, json=body) as response:
                    try:
                        return response.status, await response.read()
                    except aiohttp.ClientPayloadError:  # the connection closed mid-answer
                        return response.status, b""

            async def waiting():
                async with client.post(url, json=dict(body, stream=False)) as response:
                    return response.status, await response.json()

            running = asyncio.create_task(stream())
            await eventually(lambda: mesh.tail.health()["channels"] == 1)
            queued = asyncio.create_task(waiting())
            await eventually(lambda: mesh.head.health()["queued"] == 1)
            started = time.monotonic()
            await mesh.head.shutdown()
            assert 0.4 < time.monotonic() - started < 5
            status, answer = await queued
            assert status == 503 and answer["error"]["code"] == "shutting_down"
            status, text = await running
            assert status == 200 and b"[DONE]" not in text  # cut off, not finished
        assert len(tail.calls) < 2000
        await eventually(lambda: mesh.tail.health()["channels"] == 0)  # its close reached the tail first
