"""Prompt prefixes shared across clients (issue 63), and a context limit (`--ctx-size`).

Real node processes (a head and a tail), the real model in float32, greedy. Clients that send
the same long system prompt with different questions share its KV on every shard: the first
computes it, later ones report it in `cached_tokens` and prefill only the rest; every answer's
tokens are transformers' `generate()` on the whole prompt, whether shared, near-identical (one
token apart) or salted apart.
"""

import aiohttp
import pytest

from helpers import EXACT, MODEL, golden
from meshws.head.prefixes import PREFIX_BLOCK
from meshws.tools.launch import Mesh

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

STEPS = 8
SYSTEM = ("You help riders of a mountain bike club plan routes, fix their bikes on the trail and pack for long "
          "days. Answer in short numbered steps, name tools precisely, and say when a repair needs a shop. " * 10)


@pytest.fixture(scope="module")
def mesh(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=(*EXACT, "--ctx-size", "2048"),
                extra={"head": ("--shared-prefixes", "2")})
    yield mesh
    mesh.stop()


async def _ask(client, mesh, system, question, **extra):
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": STEPS, "temperature": 0, "return_token_ids": True, **extra}
    async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return answer["prompt_token_ids"], answer["choices"][0]["token_ids"], \
        answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_clients_share_a_system_prompt_and_answer_as_a_fresh_prefill(mesh, reference_model):
    async with aiohttp.ClientSession() as client:
        ids, tokens, cached = await _ask(client, mesh, SYSTEM, "My chain keeps skipping. Why?", user="alice")
        assert tokens == golden(reference_model, ids, STEPS) and cached == 0, "the first computes the prefix"
        kept = (len(ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
        system_tokens = None
        for question in ("What should I pack for a six hour ride?", "How do I bleed hydraulic brakes?"):
            other, tokens, cached = await _ask(client, mesh, SYSTEM, question, user="bob")
            assert tokens == golden(reference_model, other, STEPS)
            shared = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
            system_tokens = shared
            assert cached == min(shared // PREFIX_BLOCK * PREFIX_BLOCK, kept) >= 4 * PREFIX_BLOCK, (cached, shared)

        # One token apart inside the first block: only the tokens before it are shared, and the answer is fresh.
        near = SYSTEM.replace("mountain bike club", "mountain bike team", 1)
        near_ids, tokens, cached = await _ask(client, mesh, near, "My chain keeps skipping. Why?")
        assert tokens == golden(reference_model, near_ids, STEPS)
        differ = next(i for i, (a, b) in enumerate(zip(ids, near_ids)) if a != b)
        assert differ < PREFIX_BLOCK and cached == 0, "whole blocks only: never the tokens before a difference"

        # A salt keeps tenants apart: nothing shared with the unsalted, then shared among the same salt.
        _, tokens, cached = await _ask(client, mesh, SYSTEM, "What should I pack for a six hour ride?",
                                       cache_salt="tenant-b")
        assert cached == 0
        _, _, cached = await _ask(client, mesh, SYSTEM, "How do I true a wheel?", cache_salt="tenant-b")
        assert cached >= system_tokens - PREFIX_BLOCK
        _, _, cached = await _ask(client, mesh, SYSTEM, "How do I true a wheel?", cache_prompt=False)
        assert cached == 0, "cache_prompt false: no shared prefix"

    # At most two prefixes are kept (--shared-prefixes 2): between answers each shard holds them, apart from its
    # sessions (none), and their blocks once.
    for node in mesh.nodes:
        health = node.wait_sessions(0)
        assert (health["sessions"], health["prefixes"]) == (0, 2) and health["cache_bytes"] > 0
    assert mesh.head.health()["kept_sessions"]["prefixes"]["kept"] == 2


async def test_the_context_limit_is_ctx_size(mesh):
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{mesh.head.url}/v1/models") as response:
            model = (await response.json())["data"][0]
        assert model["max_model_len"] == 2048
        long = "Spokes, nipples and rims. " * 400  # about 3,200 tokens
        body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 4}
        async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
            error = (await response.json())["error"]
            assert response.status == 400 and error["code"] == "context_length_exceeded"
            assert "2048" in error["message"]
        body["messages"][0]["content"] = "Spokes, nipples and rims. " * 120  # about 1,000 tokens
        async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200 and 900 < answer["usage"]["prompt_tokens"] < 2048, answer
