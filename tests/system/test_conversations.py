"""Conversations stay warm (issue 17): the next turn prefills only what is new, with the same text.

Real node processes, the real model in float32, greedy. Every turn's text is checked
against transformers' `generate()` on the whole conversation (what a fresh prefill
gives), and `cached_tokens` against the prefix the turn shares with what the shards'
caches hold: the previous prompt and the answer's tokens that were fed back.
"""

import asyncio
import os
import time

import aiohttp
import pytest

from helpers import EXACT, MODEL, golden
from meshws.head.conversation import common_prefix
from meshws.tools.launch import Mesh, NodeProcess

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

STEPS = 12
SYSTEM = ("You are a patient assistant for a small bicycle repair shop in a hilly town. " * 3
          + "Answer briefly, name tools precisely, and never invent prices. " * 3).strip()
QUESTIONS = ["How do I fix a flat tire?", "Which tools do I need for that?", "And how long does it take?",
             "Thanks. What about a squeaky chain?"]
WARM = ("--warm-sessions", "2", "--warm-ttl", "6", "--shared-prefixes", "0")  # (prefixes: test_shared_prefixes)


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


@pytest.fixture(scope="module")
def two(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT, extra={"head": WARM})
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def three(embedded_model):
    mesh = Mesh([("head", "0-9"), ("middle", "10-19"), ("tail", "20-29")], common=EXACT, extra={"head": WARM})
    yield mesh
    mesh.stop()


class Reference:
    """What a fresh prefill of each turn gives, and what the caches hold after it."""

    def __init__(self, tokenizer, reference_model):
        self.tokenizer, self.model = tokenizer, reference_model

    def ids(self, messages):
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def answer(self, messages):
        """(text, token ids of the prompt, ids the caches hold afterwards)."""
        ids = self.ids(messages)
        tokens = golden(self.model, ids, STEPS)
        fed = tokens if len(tokens) < STEPS else tokens[:-1]  # the last sampled token is never fed back
        return self.tokenizer.decode(tokens, skip_special_tokens=True), ids, ids + fed


def expected_reuse(held, ids):
    return min(common_prefix(held, ids), len(ids) - 1) if held else 0


class ChatClient:
    """One /ws/chat socket: its turns are one conversation."""

    def __init__(self, ws):
        self.ws = ws

    async def turn(self, messages):
        await self.ws.send_json({"type": "chat", "messages": messages, "max_tokens": STEPS, "temperature": 0})
        while True:
            message = await self.ws.receive_json(timeout=120)
            assert message["type"] != "error", message
            if message["type"] == "done":
                return message

    async def reset(self):
        await self.ws.send_json({"type": "reset", "id": "r1"})
        assert await self.ws.receive_json(timeout=30) == {"type": "reset", "id": "r1"}


async def _converse(turn, reference, questions, check_between=None):
    """Ask `questions` in order through `turn(messages) -> (text, cached_tokens)`; each checked against a prefill."""
    messages, held, reused = [{"role": "system", "content": SYSTEM}], [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        text, cached = await turn(messages)  # (asked first: the reference's work must not age a warm session)
        want, ids, after = reference.answer(messages)
        assert text == want, (question, text, want)
        assert cached == expected_reuse(held, ids), (question, cached, expected_reuse(held, ids))
        reused.append(cached)
        held = after
        messages.append({"role": "assistant", "content": text})
        if check_between is not None:
            check_between()
    return messages, reused


def _sessions(mesh):
    return [node.health()["sessions"] for node in mesh.nodes]


@pytest.mark.parametrize("size", ["two", "three"])
async def test_ws_chat_turns_reuse_the_cache_and_give_the_fresh_text(size, request, tokenizer, reference_model):
    mesh = request.getfixturevalue(size)
    reference = Reference(tokenizer, reference_model)
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{mesh.head.ws_url}/ws/chat") as ws:
            chat = ChatClient(ws)

            async def turn(messages):
                done = await chat.turn(messages)
                assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == done["cached_tokens"]
                return done["text"], done["cached_tokens"]

            def kept_open():  # between turns, every shard holds the conversation's session
                assert _sessions(mesh) == [1] * len(mesh.nodes)

            messages, reused = await _converse(turn, reference, QUESTIONS, kept_open)
            assert reused[0] == 0 and all(count > 100 for count in reused[1:]), reused
            assert mesh.head.health()["kept_sessions"]["conversations"] == 1

            # An edited earlier message: reuse stops at the edit, and the text is still the fresh one.
            edited = [dict(m) for m in messages[:3]]
            edited[1]["content"] = "How do I fix a flat tire on a tubeless wheel?"
            edited = edited[:2]
            want, ids, _ = reference.answer(edited)
            text, cached = await turn(edited)
            assert text == want
            first = reference.ids(messages[:2])
            assert 0 < cached == common_prefix(first, ids) < len(first)
            # Regenerate: the same prompt again keeps all of it but its last token (a one-position step).
            again, cached = await turn(edited)
            assert again == want and cached == len(ids) - 1

            await chat.reset()
            for node in mesh.nodes:
                assert node.wait_sessions(0, timeout=3)["sessions"] == 0, node.name
            text, cached = await turn(messages[:2])  # a new conversation after the reset
            assert cached == 0 and text == reference.answer(messages[:2])[0]
        # the socket's close releases the session everywhere
        for node in mesh.nodes:
            health = node.wait_sessions(0, timeout=3)
            assert health["sessions"] == 0 and health["cache_bytes"] == 0, node.name


@pytest.mark.parametrize("size", ["two", "three"])
async def test_the_openai_client_reuses_warm_sessions(size, request, tokenizer, reference_model):
    from openai import AsyncOpenAI

    mesh = request.getfixturevalue(size)
    reference = Reference(tokenizer, reference_model)
    client = AsyncOpenAI(base_url=f"{mesh.head.url}/v1", api_key="unused", max_retries=0)

    async def turn(messages):
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=STEPS,
                                                      temperature=0)
        return answer.choices[0].message.content, answer.usage.prompt_tokens_details.cached_tokens

    try:
        messages, reused = await _converse(turn, reference, QUESTIONS[:3])
        assert reused[0] == 0 and all(count > 100 for count in reused[1:]), reused
        answer = await client.chat.completions.create(model=MODEL, messages=messages[:-1], max_tokens=STEPS,
                                                      temperature=0, extra_body={"cache_prompt": False})
        assert answer.usage.prompt_tokens_details.cached_tokens == 0  # llama-server's opt-out: no warm session
        assert answer.choices[0].message.content == messages[-1]["content"]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{mesh.head.url}/metrics") as response:
                metrics = await response.text()
        counted = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                   if line.startswith(("meshws_session_reuse_total", "meshws_reused_prompt_tokens_total"))}
        assert counted['meshws_session_reuse_total{result="hit"}'] >= 2, counted
        assert counted["meshws_reused_prompt_tokens_total"] >= sum(reused), counted
    finally:
        await client.close()


async def test_the_warm_pool_is_bounded_and_timed(two, tokenizer):
    """With --warm-sessions 2: five finished conversations leave at most 2 sessions anywhere; the TTL, none."""
    async with aiohttp.ClientSession() as client:
        for index in range(5):
            body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "system", "content": f"Conversation number {index}. " + SYSTEM},
                {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]}
            async with client.post(f"{two.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
            assert all(count <= 2 for count in _sessions(two)), _sessions(two)
    assert two.head.health()["kept_sessions"]["warm"] == 2
    assert _sessions(two) == [2, 2]
    for node in two.nodes:  # the TTL (6 s) and the sweep (every 1.5 s) close them
        assert node.wait_sessions(0, timeout=15)["sessions"] == 0, node.name
    assert two.head.health()["kept_sessions"]["warm"] == 0


async def test_a_restarted_tail_means_a_full_prefill_with_the_same_text(three, tokenizer, reference_model):
    """The tail dies between two turns and comes back on its port: the next turn prefills in full, same text."""
    reference = Reference(tokenizer, reference_model)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{three.head.ws_url}/ws/chat") as ws:
            chat = ChatClient(ws)
            first = await chat.turn(messages)
            assert first["text"] == reference.answer(messages)[0]
            old = three.nodes[-1]
            old.kill()
            three.nodes[-1] = NodeProcess("--role", "tail", "--layers", "20-29", *EXACT, "--threads",
                                          str(max(1, (os.cpu_count() or 1) // 3)), name="tail again",
                                          port=old.port).wait_started()
            three.head.wait_ready(60)
            messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": QUESTIONS[1]}]
            again = await chat.turn(messages)
            assert again["text"] == reference.answer(messages)[0]
            assert again["cached_tokens"] == 0  # the new tail had nothing: a full prefill
            third = messages + [{"role": "assistant", "content": again["text"]},
                                {"role": "user", "content": QUESTIONS[2]}]
            done = await chat.turn(third)
            assert done["text"] == reference.answer(third)[0] and done["cached_tokens"] > 100
    deadline = time.monotonic() + 5
    while any(_sessions(three)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert _sessions(three) == [0, 0, 0]
