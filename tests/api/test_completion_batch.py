"""Several prompts in one /v1/completions request (on fake shards): each its own session, choices indexed as
OpenAI numbers them, usage summed, bounded in count and size, and queued like any request."""

import aiohttp
import pytest

from fakes import CachedHeadBackend, LoopTailBackend, eventually, fake_mesh

# The fake tail answers " a" until the session holds 8 positions, then ends: a prompt's length shows in its answer.
PROMPTS = [[3, 4], [3, 4, 5, 6, 7], "text", [7]]


async def post(url, body):
    async with aiohttp.ClientSession() as client, client.post(url + "/v1/completions", json=body) as response:
        return response.status, await (response.json() if not body.get("stream") or response.status != 200
                                       else response.text())


def body(prompt, **extra):
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 20, "temperature": 0, **extra}


async def test_each_prompt_answers_as_it_would_alone_and_choices_are_indexed_prompt_times_n_plus_choice():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend(), max_generations=2) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        alone = [(await post(url, body(prompt, return_token_ids=True)))[1] for prompt in PROMPTS]
        status, batch = await post(url, body(PROMPTS, n=2, return_token_ids=True))
        assert status == 200, batch
        assert [choice["index"] for choice in batch["choices"]] == list(range(8))  # 4 prompts x 2, two slots
        for index, choice in enumerate(batch["choices"]):
            assert choice["text"] == alone[index // 2]["choices"][0]["text"]
            assert choice["token_ids"] == alone[index // 2]["choices"][0]["token_ids"]
        assert len({choice["text"] for choice in batch["choices"]}) > 1  # the prompts did differ
        assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert batch["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
        assert batch["prompt_token_ids"] == [[3, 4], [3, 4, 5, 6, 7], [5] * 6, [7]]
        # A list holding one token list is one prompt (lm-evaluation-harness sends that).
        status, one = await post(url, body([[3, 4]], echo=True, logprobs=1))
        assert status == 200 and len(one["choices"]) == 1 and one["choices"][0]["text"].startswith(" c<4>")
        await eventually(lambda: not mesh.tail.backend.sessions.session_ids())


async def test_a_batch_streams_each_choice_with_its_index():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        whole = (await post(url, body(PROMPTS)))[1]
        status, text = await post(url, body(PROMPTS, stream=True, stream_options={"include_usage": True}))
        import orjson

        events = [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        streamed, ends = {}, {}
        for event in events:
            for choice in event["choices"]:
                streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    ends[choice["index"]] = choice["finish_reason"]
        assert streamed == {c["index"]: c["text"] for c in whole["choices"]}
        assert ends == {c["index"]: c["finish_reason"] for c in whole["choices"]}
        assert events[-1]["usage"] == whole["usage"] and text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("prompt, extra, needle", [
    ([[1]] * 65, {}, "at most 64 prompts"),
    ([[1]] * 33, {"n": 2}, "33 x 2"),
    ([], {}, "must be a string"),
    ([[1], 2], {}, "must be a string"),
    ([[1], []], {}, "must be a string"),
    ([[1], [True]], {}, "must be a string"),
    (["a", "b"], {"stream": True, "logprobs": 1}, "stream carries text only"),
    ([[1] * 1500] * 12, {}, "context windows"),  # each fits; together they are more than 8 contexts
    ([[1], [1] * 2100], {}, "prompt 1:"),  # one too long: the whole request is refused, naming it
])
async def test_batches_are_bounded_and_a_bad_prompt_refuses_the_request(prompt, extra, needle):
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        status, answer = await post(url, body(prompt, **extra))
        assert status == 400 and needle in answer["error"]["message"], answer
        assert answer["error"]["param"] in ("prompt", "n") and len(str(answer)) < 600
        assert not mesh.tail.backend.sessions.session_ids()
