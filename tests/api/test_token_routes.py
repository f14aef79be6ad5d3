"""/tokenize and /detokenize: a bounded number at work at once (past it a 429, nothing queued), each admitted as a
generation is (a slot from the head's queue: when every slot is busy they wait, and time out with a 503)."""

import asyncio
from types import SimpleNamespace

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from meshws.api.tokens import MAX_TOKENIZING, TokenRoutes
from meshws.head.admission import AdmissionQueue
from meshws.head.service import HeadService


def fake_head(tokenize, slots=8, timeout=60.0):
    queue = AdmissionQueue(slots, 4, timeout)
    head = SimpleNamespace(served_names=["m"], context_length=64, vocab_size=10, tokenize=tokenize,
                           decode=lambda ids: "x" * len(ids), queue=queue)
    head.admit_local = lambda: HeadService.admit_local(head)
    return head


async def test_tokenize_waits_for_a_generation_slot_and_gets_503_when_none_comes():
    async def tokenize(text):
        return [1]

    head = fake_head(tokenize, slots=1, timeout=0.3)
    busy = await head.queue.enter()  # a generation holds the only slot
    app = web.Application()
    app.router.add_post("/tokenize", TokenRoutes(head).tokenize)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as client:
        async with client.post(str(server.make_url("/tokenize")), json={"prompt": "x"}) as response:
            assert response.status == 503 and "Retry-After" in response.headers
        busy.release()
        async with client.post(str(server.make_url("/tokenize")), json={"prompt": "x"}) as response:
            assert response.status == 200 and (await response.json())["tokens"] == [1]
    assert head.queue.running == 0


async def test_tokenize_requests_beyond_the_bound_get_429_and_the_rest_answer():
    release = asyncio.Event()
    started = []

    async def tokenize(text):
        started.append(text)
        await release.wait()
        return [1, 2]

    head = fake_head(tokenize)
    routes = TokenRoutes(head)
    app = web.Application()
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as client:
        url = str(server.make_url(""))

        async def ask(path, body):
            async with client.post(url + path, json=body) as response:
                return response.status, await response.json()

        held = [asyncio.create_task(ask("/tokenize", {"prompt": f"p{i}"})) for i in range(MAX_TOKENIZING)]
        while len(started) < MAX_TOKENIZING:
            await asyncio.sleep(0.01)
        status, answer = await ask("/tokenize", {"prompt": "one more"})
        assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
        assert (await ask("/detokenize", {"tokens": [1]}))[0] == 429  # (the same bound)
        release.set()
        assert [(await task)[0] for task in held] == [200] * MAX_TOKENIZING
        assert (await ask("/tokenize", {"prompt": "again"}))[1]["tokens"] == [1, 2] and routes.working == 0
        assert started == [f"p{i}" for i in range(MAX_TOKENIZING)] + ["again"]
