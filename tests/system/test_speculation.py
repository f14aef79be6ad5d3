"""More than one token per lap (issue 16): drafts verified by the tail, exact for greedy and seeded sampling.

One tail, reached through a relay that delays every byte by 25 ms each way (a long
link), and two heads on it: one guessing (`--draft ngram`, the default), one not
(`--draft none`). Their texts must be identical — and greedy, `generate()`'s — while
the guessing head needs fewer laps (decode frames reaching the tail) than tokens.
"""

import asyncio
import os

import aiohttp
import pytest

from helpers import EXACT, MODEL, golden
from meshws.tools.launch import NodeProcess
from meshws.tools.relay import RelayThread

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

THREADS = ("--threads", str(max(1, (os.cpu_count() or 1) // 3)))
REPEAT = ("Copy this list exactly, one item per line: red apple, green pear, yellow banana, purple plum, "
          "orange mango, red apple, green pear, yellow banana.")


@pytest.fixture(scope="module")
def nodes(embedded_model):
    tail = NodeProcess("--role", "tail", "--layers", "15-29", *EXACT, *THREADS, name="tail").wait_started()
    relay = RelayThread(tail.port, 0.025)
    heads = {}
    try:
        for draft in ("ngram", "none"):
            heads[draft] = NodeProcess("--role", "head", "--layers", "0-14", *EXACT, *THREADS, "--draft", draft,
                                       "--peer", f"ws://127.0.0.1:{relay.port}", name=f"head {draft}").wait_started()
        for head in heads.values():
            head.wait_ready(60)
        yield heads, tail
    finally:
        for head in heads.values():
            head.stop()
        relay.stop()
        tail.stop()


async def _decode_frames(tail):
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{tail.url}/metrics") as response:
            text = await response.text()
    lines = [line for line in text.splitlines()
             if line.startswith('meshws_frames_total{direction="in",type="fwd_decode"}')]
    return float(lines[0].split()[-1]) if lines else 0.0  # none yet


async def _ask(head, tail, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 48, **fields}
    before = await _decode_frames(tail)
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{head.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    await asyncio.sleep(0.2)
    return answer, await _decode_frames(tail) - before


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


async def test_greedy_with_drafts_is_generate_in_fewer_laps(nodes, tokenizer, reference_model):
    heads, tail = nodes
    guessing, laps = await _ask(heads["ngram"], tail, temperature=0, return_token_ids=True)
    plain, plain_laps = await _ask(heads["none"], tail, temperature=0, return_token_ids=True)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": REPEAT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    want = golden(reference_model, ids, 48)
    assert guessing["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"] == want
    tokens = guessing["usage"]["completion_tokens"]
    eos = guessing["choices"][0]["finish_reason"] == "stop"  # the end of answer took a lap, and is no token
    assert plain_laps == tokens - 1 + eos  # one lap per token after the prefill's
    assert laps < 0.75 * plain_laps, (laps, plain_laps)  # the list repeats: most laps keep guesses
    spec = guessing["usage"]["speculation"]
    assert spec["laps"] == laps and spec["accepted_draft_tokens"] > 0
    assert spec["tokens_per_lap"] == round((spec["laps"] + spec["accepted_draft_tokens"]) / spec["laps"], 3)
    assert "speculation" not in plain["usage"]
    for head in heads.values():
        assert head.wait_sessions(0)["sessions"] == 0
    assert tail.wait_sessions(0)["sessions"] == 0


@pytest.mark.parametrize("fields", [
    {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"temperature": 0.7, "top_k": 20, "seed": 11, "frequency_penalty": 0.4, "presence_penalty": 0.2},
], ids=["seeded", "seeded-penalties"])
async def test_seeded_sampling_with_drafts_returns_the_same_text(nodes, fields):
    heads, tail = nodes
    guessing, laps = await _ask(heads["ngram"], tail, **fields)
    plain, plain_laps = await _ask(heads["none"], tail, **fields)
    assert guessing["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert guessing["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert guessing["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert laps <= plain_laps


async def test_logprobs_through_laps_with_drafts_are_those_of_one_token_laps(nodes):
    """A lap that verifies drafts reports each accepted token's log-probability from its own row, with the
    penalties over the tokens before it: the same figures as one token per lap."""
    heads, tail = nodes
    fields = {"logprobs": True, "top_logprobs": 2, "temperature": 0, "frequency_penalty": 0.3}
    (guessing, laps), (plain, _) = [await _ask(heads[draft], tail, **fields) for draft in ("ngram", "none")]
    assert guessing["usage"]["speculation"]["accepted_draft_tokens"] > 0 and laps < plain["usage"]["completion_tokens"]

    def figures(answer):  # (token, logprob, alternatives' logprobs)
        return [(entry["token"], entry["logprob"], [alt["logprob"] for alt in entry["top_logprobs"]])
                for entry in answer["choices"][0]["logprobs"]["content"]]

    with_drafts, one_by_one = figures(guessing), figures(plain)
    assert [f[0] for f in with_drafts] == [f[0] for f in one_by_one]
    assert len(one_by_one) == plain["usage"]["completion_tokens"]
    for (_, logprob, top), (_, want, want_top) in zip(with_drafts, one_by_one):  # a k-row step's numerics: 1e-3
        assert abs(logprob - want) < 1e-3 and all(abs(a - b) < 1e-3 for a, b in zip(top, want_top))


FRUITS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "required": ["fruit"], "additionalProperties": False,
    "properties": {"fruit": {"type": "string", "enum": ["apple", "pear", "banana", "plum", "mango"]}}}}


async def test_a_grammar_and_drafts_together_give_the_text_of_one_token_laps(nodes):
    """Structured output with speculation: the tail masks each row of a lap, so guesses the schema forbids are
    rejected like wrong ones; the answer is the one-token-per-lap answer, valid, and its repeats were guessed."""
    import json

    import jsonschema

    heads, tail = nodes
    schema = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": FRUITS}}
    (guessing, _), (plain, _) = [await _ask(heads[draft], tail, temperature=0, response_format=schema,
                                            max_tokens=90) for draft in ("ngram", "none")]
    text = guessing["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), FRUITS)
    assert guessing["usage"]["speculation"]["accepted_draft_tokens"] > 0


async def test_stop_strings_and_streaming_behave_as_without_drafts(nodes):
    heads, tail = nodes
    texts = {}
    for draft, head in heads.items():
        body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 48,
                "temperature": 0, "stream": True, "stop": ["plum"]}
        chunks = []
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{head.url}/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunks.append(line)
        texts[draft] = b"".join(chunks)
        assert b'"finish_reason":"stop"' in chunks[-1]
    import json

    def content(stream):
        return "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in stream.split(b"\n") if line.startswith(b"data: {"))

    assert content(texts["ngram"]) == content(texts["none"]) and "plum" not in content(texts["ngram"])


QUOTES = ["The river bends twice before the old mill, then runs straight to the sea past the church.",
          "Seven ships left the harbour at dawn, and only three came back before the winter storms began.",
          "Bread, butter, two apples, a jar of honey and a map of the northern hills were all she carried."]


async def test_three_shards_with_drafts_give_generate_in_fewer_laps(tokenizer, reference_model):
    """Head -> middle -> tail, drafts on, three sessions at once: every answer is `generate()`'s, in fewer laps,
    and the middle forwards each lap's drafts to the tail."""
    from meshws.tools.launch import Mesh

    mesh = Mesh([("head", "0-9"), ("middle", "10-19"), ("tail", "20-29")], common=EXACT)
    try:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {quote}"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
                   for quote in QUOTES]
        before = await _decode_frames(mesh.tail)

        async def one(ids):
            body = {"model": MODEL, "prompt": ids, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{mesh.head.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()

        answers = await asyncio.gather(*(one(ids) for ids in prompts))
        for ids, answer in zip(prompts, answers):
            assert answer["choices"][0]["token_ids"] == golden(reference_model, ids, 40)
        tokens = sum(answer["usage"]["completion_tokens"] for answer in answers)
        assert all(answer["usage"]["speculation"]["accepted_draft_tokens"] > 0 for answer in answers)
        assert await _decode_frames(mesh.tail) - before < 0.75 * tokens
        for node in mesh.nodes:
            assert node.wait_sessions(0)["sessions"] == 0, node.name
        await _caches_hold_prompt_and_accepted_tokens_after_every_lap(mesh)
    finally:
        mesh.stop()


async def _caches_hold_prompt_and_accepted_tokens_after_every_lap(mesh):
    """Every hop reports its cache's length after each lap (measured on the cache): a lap at `past_len` =
    prompt + accepted tokens - 1 (the last is fed now) leaves exactly that plus the lap's positions, so the
    drafts a lap's tail rejected are gone from every cache by the next lap."""
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{mesh.head.url}/ws/chat") as ws:
            await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 48,
                                "temperature": 0, "trace": True})
            start = await ws.receive_json(timeout=120)
            while (message := await ws.receive_json(timeout=120))["type"] == "delta":
                pass
    assert start["type"] == "start" and message["type"] == "done", message
    hops, prompt = message["hops"], start["prompt_tokens"]
    trace, generated, rejected_then_checked = hops["trace"], 0, 0
    assert hops["laps"] == len(trace) and [hop["node"].split("@")[0] for hop in hops["hops"]] == ["middle", "tail"]
    for number, lap in enumerate(trace):
        past_len = 0 if number == 0 else prompt + generated - 1
        assert [hop["cache_len"] for hop in lap["hops"]] == [past_len + lap["positions"]] * 3, (number, lap)
        assert all(hop["ms"] > 0 for hop in lap["hops"]) and lap["ms"] >= sum(hop["ms"] for hop in lap["hops"])
        middle, tail = lap["hops"][1:]  # the middle says how long the tail's answer took to come back to it
        assert middle["wait_ms"] >= tail["ms"] and "wait_ms" not in tail, lap
        rejected_then_checked += number + 1 < len(trace) and lap["tokens"] < lap["positions"]
        generated += lap["tokens"]
    assert trace[0]["positions"] == prompt and message["usage"]["completion_tokens"] <= generated
    assert rejected_then_checked > 0  # some lap's drafts were rejected, and the next lap saw them dropped
    assert max(lap["positions"] for lap in trace) > 1
    # The links' share, split link by link from the middle's wait: head -> middle, middle -> tail.
    links = hops["links"]
    names = [(link["from"].split("@")[0], link["to"].split("@")[0]) for link in links]
    assert names == [("head", "middle"), ("middle", "tail")]
    assert sum(link["ms"] for link in links) == pytest.approx(hops["network_ms"], abs=0.5)


async def test_the_links_share_of_a_lap_is_the_relays_delay(nodes):
    """Through the relay (25 ms each way) every lap spends at least 50 ms on the link: the head's split of a lap
    into its own layers, the tail's report and the rest finds it there, in `done` and in /metrics."""
    heads, _ = nodes
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{heads['none'].url}/ws/chat") as ws:
            await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "Name three birds."}],
                                "max_tokens": 8, "temperature": 0})
            while (message := await ws.receive_json(timeout=120))["type"] != "done":
                assert message["type"] in ("start", "delta"), message
        async with client.get(f"{heads['none'].url}/metrics") as response:
            metrics = await response.text()
    hops = message["hops"]
    assert hops["laps"] >= 2 and [hop["node"].split("@")[0] for hop in hops["hops"]] == ["tail"]
    assert hops["network_ms"] >= 0.05 * 1000 * hops["laps"] * 0.95  # the relay's 50 ms a lap (timer slack)
    assert hops["head_ms"] > 0 and hops["hops"][0]["ms"] > 0
    for part in ("head", "hop1", "network"):
        name = f'meshws_lap_seconds_total{{part="{part}"}}'
        line = next(line for line in metrics.splitlines() if line.startswith(name))
        assert float(line.split()[-1]) > 0, line
