"""Issue 61's client-reachable stalls, re-run against a real head + tail: costly grammars and template-heavy bodies
from several clients at once get 4xx answers, while /health stays quick and a small answer sent 1 s into the
flood is not held until it ends; each attack is bounded to a few seconds."""

import asyncio
import statistics
import time

import aiohttp
import pytest

from helpers import MODEL
from meshws.tools.launch import Mesh

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

ATTACKERS = 4
ROUNDS = 10.0  # seconds each flood runs


@pytest.fixture(scope="module")
def mesh(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")])
    yield mesh
    mesh.stop()


def any_of(count):
    """An anyOf of `count` objects: 0.3 s for llguidance at 700."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(count)]}


def optional_properties(count):
    """`count` optional properties of several types: refused as too big by llguidance after 0.4 s at 1,000."""
    return {"type": "object", "properties": {f"p{i}": {"type": ["string", "number", "null"]} for i in range(count)}}


def attacks():
    """Request bodies as (path, body) that cost the head work before they could be refused."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tool = {"type": "function", "function": {"name": "f", "parameters": any_of(700)}}
    empty_call = {"type": "function_call", "call_id": "", "name": "f", "arguments": ""}
    calls = [{"id": "", "type": "function", "function": {"name": "f", "arguments": ""}}] * 20000
    return [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": any_of(700)}}}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": optional_properties(1000)}}}),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
        ("/v1/responses", {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}]
                           + [empty_call] * 60000, "max_output_tokens": 4}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "", "tool_calls": calls}]}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": calls}]}),
    ]


async def small_answer(client, url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0}
    began = time.monotonic()
    async with client.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.json()
    return time.monotonic() - began


async def test_grammar_and_template_floods_get_4xx_and_the_head_stays_responsive(mesh):
    url = mesh.head.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        idle = min([await small_answer(client, url) for _ in range(3)])
        statuses: list[int] = []
        done = asyncio.Event()

        async def attacker(index):
            bodies = attacks()
            turn = index
            while not done.is_set():
                path, body = bodies[turn % len(bodies)]
                turn += 1
                async with client.post(f"{url}{path}", json=body) as response:
                    statuses.append(response.status)
                    await response.read()

        async def health_times():
            times = []
            while not done.is_set():
                began = time.monotonic()
                async with client.get(f"{url}/health") as response:
                    await response.read()
                times.append(time.monotonic() - began)
                await asyncio.sleep(0.05)
            return times

        flood = [asyncio.create_task(attacker(index)) for index in range(ATTACKERS)]
        polled = asyncio.create_task(health_times())
        await asyncio.sleep(1.0)  # the flood is on
        beside = await small_answer(client, url)
        await asyncio.sleep(max(0.0, ROUNDS - 1.0 - beside))
        done.set()
        await asyncio.gather(*flood)
        times = await polled
    assert statuses and all(400 <= status < 500 for status in statuses), sorted(set(statuses))
    assert len(statuses) >= ATTACKERS * 3  # each attack is refused quickly
    assert statistics.median(times) <= 0.25, statistics.median(times)
    # Not held until the flood ends (ROUNDS - 1 s after it was sent): a client that floods cannot starve the others
    # for as long as it floods. No tighter bound: the compiles' two threads take both of a 2-core host's cores, and
    # honest sharing made it 1.7 s against 0.37 s idle in CI.
    assert beside < ROUNDS - 1.0, (beside, idle)
