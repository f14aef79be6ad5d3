"""SSE streams that stay silent — waiting in the admission queue, or behind a long first step — get `: ping`
comment lines every --sse-ping seconds (so proxies do not cut them), and still end as they should."""

import asyncio
import time

import aiohttp
import openai

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class FirstStepSlowTail(LoopTailBackend):
    """A long prefill: the first step of every session takes `delay` seconds, the rest none."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def answer(self, past_len):
        if not past_len:
            time.sleep(self.delay)
        return super().answer(past_len)


async def _lines(client, url, body):
    """The stream's lines, each with the time it arrived."""
    began, lines = time.monotonic(), []
    async with client.post(url, json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        async for line in response.content:
            if line.strip():
                lines.append((time.monotonic() - began, line.strip()))
    return lines


async def test_a_stream_waiting_in_the_queue_and_behind_a_long_prefill_is_pinged():
    async with fake_mesh(CachedHeadBackend(), FirstStepSlowTail(0.8), max_generations=1, sse_ping=0.25) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            first = asyncio.create_task(_lines(client, url, BODY))
            await asyncio.sleep(0.2)
            second = asyncio.create_task(_lines(client, url, BODY))  # waits ~0.8 s for the slot
            for lines in await asyncio.gather(first, second):
                texts = [text for _, text in lines]
                data = [text for text in texts if text.startswith(b"data: {")]
                assert texts[-1] == b"data: [DONE]" and b'"finish_reason":"stop"' in data[-1]
                pings = [at for at, text in lines if text == b": ping"]
                assert len(pings) >= 2, texts  # 0.8 s of silence, a ping every 0.25 s
                first_token = next(at for at, text in lines if b'"content":" a"' in text)
                assert all(at < first_token for at in pings)  # they kept the silence company, no more
        # The official client reads through the pings.
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.head_port}/v1", api_key="x", max_retries=0)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model="fake-model", messages=BODY["messages"], stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith(" a a")


async def test_a_queue_timeout_after_the_stream_started_arrives_as_an_error_event():
    async with fake_mesh(CachedHeadBackend(), FirstStepSlowTail(1.2), max_generations=1, sse_ping=0.2,
                         queue_timeout=0.6) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            first = asyncio.create_task(_lines(client, url, BODY))
            await asyncio.sleep(0.2)
            lines = await _lines(client, url, BODY)  # pinged while waiting, then the queue gives up
            texts = [text for _, text in lines]
            assert texts[0] == b": ping" and texts[-1] == b"data: [DONE]"
            assert b'"code":"queue_timeout"' in texts[-2] and b'"choices"' not in b"".join(texts)
            assert [text for _, text in await first][-1] == b"data: [DONE]"
