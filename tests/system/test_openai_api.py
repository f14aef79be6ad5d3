"""The head's public API against a real head + tail: the official openai client, /ws/chat, errors."""

import asyncio
import subprocess
import sys

import aiohttp
import openai
import orjson
import pytest

from fakes import CachedHeadBackend, CachedTailBackend, fake_mesh
from helpers import EXACT, ROOT
from meshws.tools.launch import Mesh

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Explain in detail how a bicycle works."}]


@pytest.fixture(scope="module")
def mesh(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT,
                extra={"head": ("--served-model-name", "smol", "--served-model-name", "gpt-4o-mini,assistant")})
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"{mesh.head.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


def test_models_list_names_the_aliases_and_the_context_length(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL, "smol", "gpt-4o-mini", "assistant"]
    assert {model.max_model_len for model in models.data} == {8192}  # SmolLM2's context, as vLLM names it
    assert client.models.retrieve("smol").id == "smol" and client.models.retrieve(MODEL).context_length == 8192
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def _metrics(mesh):
    import urllib.request

    with urllib.request.urlopen(f"{mesh.head.url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def test_request_metrics_count_every_request_and_its_tokens(client, mesh):
    before = _metrics(mesh)
    answers = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              max_tokens=6, temperature=0)
               for question in ("Name a colour.", "Name a fruit.", "Name a bird.")]
    after = _metrics(mesh)

    def grew(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"meshws_{histogram}_count") == 3, histogram
        assert grew(f"meshws_{histogram}_sum") > 0
    assert grew("meshws_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("meshws_generated_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    # One gap per lap after the first; a lap brings one token or (with drafts) more.
    assert 1 <= grew("meshws_inter_token_latency_seconds_count") <= sum(a.usage.completion_tokens - 1 for a in answers)
    assert after["meshws_generations_running"] == 0 and after["meshws_queue_depth"] == 0
    assert any(name.startswith("python_info") for name in after) and "process_cpu_seconds_total" in after


def _reference_logprobs(reference_model, prompt, tokens, temperature=None):
    """log_softmax of the whole fp32 model's logits at each generated position (scaled by the temperature)."""
    import torch

    with torch.inference_mode():
        logits = reference_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 5}], ids=["greedy", "sampled"])
def test_logprobs_are_the_samplers_distribution_and_stream_alike(client, tokenizer, reference_model, sampling):
    """Each token's log-probability and its 3 likeliest alternatives, as the whole fp32 model computes them
    (within 1e-3), after the temperature; greedy picks the top alternative; a stream carries the same entries."""
    ask = dict(model=MODEL, messages=QUESTION, max_tokens=5, logprobs=True, top_logprobs=3, **sampling)
    answer = client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    tokens, content = answer.choices[0].token_ids, answer.choices[0].logprobs.content
    assert len(content) == len(tokens) == 5 and all(len(entry.top_logprobs) == 3 for entry in content)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = _reference_logprobs(reference_model, prompt, tokens, sampling.get("temperature") or None)
    for position, (token, entry) in enumerate(zip(tokens, content)):
        assert entry.token == tokenizer.decode([token]) and bytes(entry.bytes) == entry.token.encode()
        assert abs(entry.logprob - float(want[position, token])) < 1e-3
        top = want[position].topk(3)
        assert [alt.token for alt in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert all(abs(alt.logprob - float(v)) < 1e-3 for alt, v in zip(entry.top_logprobs, top.values.tolist()))
        if not sampling["temperature"]:
            assert entry.top_logprobs[0].token == entry.token
    streamed = [entry for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs_in_the_legacy_shape(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text and len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))  # greedy: the chosen is the top
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, top_logprobs=3)
    assert caught.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("repeats", [1, 40], ids=["short", "chunked"])  # 40: past the 256-token prefill chunk
def test_echo_with_logprobs_scores_the_prompt_as_the_whole_model_does(client, tokenizer, reference_model, repeats):
    """What evaluation harnesses send (echo, logprobs=1, max_tokens=1): the prompt's text first, each prompt
    token's log-probability (the first has none) as the whole fp32 model computes it, then the answer's."""
    import torch

    prompt = "The capital of France is Paris. " * repeats + "The capital of Italy is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                       echo=True)
    ids = tokenizer(prompt)["input_ids"]
    logprobs, text = answer.choices[0].logprobs, answer.choices[0].text
    assert text.startswith(prompt) and len(logprobs.tokens) == len(ids) + 1 and len(ids) > 256 * (repeats > 1)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    with torch.inference_mode():
        want = torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = torch.tensor(logprobs.token_logprobs[1:len(ids)])
    # float32 links by default on a float32 mesh: the split scores as the whole model does (bf16 links: 3e-2)
    assert torch.allclose(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)
    assert "".join(logprobs.tokens) == text and logprobs.text_offset[len(ids)] == len(prompt)
    assert abs(logprobs.token_logprobs[-1] - float(want[-1].max())) < 1e-4  # the greedy answer's token
    # Streamed: the prompt (with its log-probabilities) is the first chunk.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == prompt and "".join(c.choices[0].text for c in chunks).startswith(text)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=9)
    assert caught.value.body["param"] == "logprobs"


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 130},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]}}}


async def test_json_schema_answers_always_parse_and_validate(mesh):
    """Ten seeded requests at temperature 1.0 at once (the tail batches their rows; the head's drafts ride
    along): every answer is JSON valid against the schema; json_object gives a JSON object."""
    import json

    import jsonschema

    client = openai.AsyncOpenAI(base_url=f"{mesh.head.url}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Invent a person. Answer in JSON."}]
    answers = await asyncio.gather(*(client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=80, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        for seed in range(10)))
    people = [json.loads(answer.choices[0].message.content) for answer in answers]
    for person, answer in zip(people, answers):
        jsonschema.validate(person, PERSON)
        assert answer.choices[0].finish_reason == "stop"
    assert len({json.dumps(person, sort_keys=True) for person in people}) > 1  # sampled, not one fixed answer
    free = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with the keys name and age of a person."}],
        max_tokens=100, temperature=0, response_format={"type": "json_object"})
    assert free.choices[0].finish_reason == "stop" and isinstance(json.loads(free.choices[0].message.content), dict)


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["city"],
                                                     "properties": {"city": {"type": "string", "maxLength": 30}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["zone"],
                                                     "properties": {"zone": {"type": "string", "maxLength": 30}}}}},
]


def test_a_required_tool_call_parses_and_its_result_gets_an_answer(client):
    """tool_choice required: the answer is a call to one of the tools, with arguments valid against its schema
    (a grammar guarantees it); the call and its result fed back get a final answer in text."""
    import json

    import jsonschema

    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    answer = client.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER_TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in WEATHER_TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"
    follow_up = ask + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}]
    final = client.chat.completions.create(model=MODEL, messages=follow_up, tools=WEATHER_TOOLS, max_tokens=40,
                                           temperature=0)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    assert not final.choices[0].message.tool_calls or final.choices[0].finish_reason == "tool_calls"
    # A named function, streamed: the call arrives whole as delta.tool_calls, then finish_reason tool_calls.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ask, tools=WEATHER_TOOLS, max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.name == "get_time" and calls[0][0].index == 0
    jsonschema.validate(json.loads(calls[0][0].function.arguments), WEATHER_TOOLS[1]["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


LAX_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]  # no additionalProperties, no maxLength: as LangChain and pydantic send
LAX_PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "number"},
                                               "height_m": {"type": "number"}}, "required": ["name", "age", "height_m"]}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1},
                                      {"temperature": 1.0, "seed": 2}], ids=["greedy", "seed1", "seed2"])
def test_a_forced_tool_call_and_a_json_schema_answer_finish_within_60_tokens(client, sampling):
    """Schemas as clients write them (objects without additionalProperties, unbounded numbers): the grammar
    refuses undeclared properties and bounds numbers and whitespace, so the embedded model ends its answer
    (without that it wrote extra properties or a long number until 200 tokens ran out)."""
    import json

    import jsonschema

    call = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris?"}], tools=LAX_TOOLS,
        tool_choice="required", max_tokens=60, **sampling)
    assert call.choices[0].finish_reason == "tool_calls", call.choices[0]
    arguments = json.loads(call.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, dict(LAX_TOOLS[0]["function"]["parameters"], additionalProperties=False))
    person = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": LAX_PERSON}}, **sampling)
    assert person.choices[0].finish_reason == "stop", person.choices[0]
    jsonschema.validate(json.loads(person.choices[0].message.content), dict(LAX_PERSON, additionalProperties=False))


def _tail_prefills(mesh):
    import urllib.request

    with urllib.request.urlopen(f"{mesh.tail.url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith('meshws_steps_total{mode="prefill"}'))


def test_n_choices_share_one_prefill(client, mesh):
    """n=3: three choices; greedy ones identical; the tail prefilled the prompt once (the other choices forked
    its cache); seeded ones differ from each other and come back the same; a stream says each choice's index."""
    before = _tail_prefills(mesh)
    greedy = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, n=3)
    assert _tail_prefills(mesh) - before == 1
    texts = [choice.message.content for choice in greedy.choices]
    assert [choice.index for choice in greedy.choices] == [0, 1, 2] and len(set(texts)) == 1 and texts[0]
    assert greedy.usage.completion_tokens == 3 * 12
    seeded = [[choice.message.content for choice in client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=4, n=3).choices] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) > 1
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                            n=2, stream=True))
    by_index = {0: "", 1: ""}
    for chunk in chunks:
        by_index[chunk.choices[0].index] += chunk.choices[0].text
    assert by_index[0] == by_index[1] and by_index[0]
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]
    assert mesh.tail.wait_sessions(0)["sessions"] == 0 and mesh.head.wait_sessions(0)["sessions"] == 0


def test_an_alias_serves_the_same_model_and_is_echoed(client):
    by_alias = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0)
    by_id = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert by_alias.model == "smol" and by_id.model == MODEL
    assert by_alias.choices[0].message.content == by_id.choices[0].message.content


async def test_tokenize_and_detokenize_as_vllm_and_llama_server_shape_them(mesh, client, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    async with aiohttp.ClientSession() as session:
        async def post(path, body):
            async with session.post(f"{mesh.head.url}{path}", json=body) as response:
                return response.status, await response.json()

        status, vllm = await post("/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200 and vllm["tokens"] == tokenizer(text)["input_ids"] and vllm["count"] == len(vllm["tokens"])
        assert vllm["max_model_len"] == 8192
        status, llama = await post("/tokenize", {"content": text, "with_pieces": True})
        assert llama["tokens"] == vllm["tokens"] and "".join(p["piece"] for p in llama["pieces"]) == text
        status, back = await post("/detokenize", {"tokens": vllm["tokens"]})
        assert status == 200 and back["prompt"] == back["content"] == text
        # Chat messages: the ids a chat request prefills, as its usage counts them.
        status, chat = await post("/v1/tokenize", {"messages": QUESTION})
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
        assert chat["count"] == answer.usage.prompt_tokens
        assert chat["tokens"] == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False)
        for path, body, param in (("/tokenize", {"prompt": text, "add_special_tokens": False}, "add_special_tokens"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/detokenize", {"tokens": [10**9]}, "tokens"),
                                  ("/tokenize", {"model": "nope", "prompt": "x"}, "model")):
            status, error = await post(path, body)
            assert status in (400, 404) and error["error"]["param"] == param, error


def test_chat_streaming_equals_non_streaming_for_greedy(client, mesh):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    text = answer.choices[0].message.content
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant"
    assert len(text) > 20
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [answer.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert chunks[-1].choices == []
    assert mesh.tail.wait_sessions(0)["sessions"] == 0


def test_completions_endpoint(client):
    answer = client.completions.create(model=MODEL, prompt="The three primary colours are", max_tokens=12,
                                       temperature=0)
    assert answer.object == "text_completion"
    assert answer.choices[0].text.strip()
    assert answer.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The three primary colours are", max_tokens=12, temperature=0, stream=True))
    assert streamed == answer.choices[0].text


def test_max_tokens_gives_finish_reason_length_and_usage_matches_the_tokenizer(client, tokenizer):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=7, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 7
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.total_tokens == len(prompt_ids) + 7
    token_ids = answer.model_extra["prompt_token_ids"], answer.choices[0].model_extra["token_ids"]
    assert token_ids[0] == prompt_ids
    assert tokenizer.decode(token_ids[1], skip_special_tokens=True) == answer.choices[0].message.content
    # max_completion_tokens is the newer name for the same limit.
    newer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert newer.usage.completion_tokens == 3


def test_stop_strings_end_the_answer_before_the_stop_text(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    stop_word = next(w for w in words[3:] if len(w) > 3)
    expected = text[: text.index(stop_word)]
    for stop in (stop_word, [stop_word, "zzzz-never"]):
        cut = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=stop)
        assert cut.choices[0].message.content == expected
        assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=stop_word, stream=True) if c.choices)
    assert streamed == expected


def test_same_seed_gives_the_same_sampled_text(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0.9,
                                              top_p=0.95, seed=seed).choices[0].message.content

    first, second = sample(1234), sample(1234)
    assert first == second
    others = {sample(seed) for seed in (1, 2, 3)}
    assert len(others | {first}) > 1, "different seeds should not all give the same text"
    penalised = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                               frequency_penalty=1.5, presence_penalty=0.5)
    assert penalised.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "the weather"}}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"logit_bias": {"100": -100}}, "logit_bias"),
    ({"extra_body": {"max_token": 5}}, "max_token"),  # a typo is refused, not a silent default
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
])
def test_fields_meshws_does_not_implement_are_refused_by_name(client, fields, param):
    """The official client's fields that meshws does not implement: a 400 naming the field, not an answer
    that silently ignored it."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 3, **fields})
    assert caught.value.body["param"] == param, caught.value.body


def test_streaming_client_that_disconnects_leaves_no_sessions(client, mesh):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=300, temperature=0,
                                            stream=True)
    for index, _ in enumerate(stream):
        if index == 3:
            assert mesh.tail.health()["sessions"] == 1
            break
    stream.close()
    assert mesh.head.wait_sessions(0)["sessions"] == 0
    assert mesh.tail.wait_sessions(0)["sessions"] == 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": MODEL}, 400, "messages"),
        ({"messages": QUESTION}, 400, "model"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "temperature": 7}, 400, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 9000}, 400, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "n": 9}, 400, "n"),
        ({"model": MODEL, "messages": QUESTION, "n": True}, 400, "n"),
        ({"model": MODEL, "messages": QUESTION, "stop": 5}, 400, "stop"),
        ({"model": MODEL, "messages": QUESTION, "stream": "yes"}, 400, "stream"),
        ({"model": "gpt-4o", "messages": QUESTION}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
    ],
)
async def test_bad_chat_requests_get_openai_shaped_errors(mesh, body, status, param):
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{mesh.head.url}/v1/chat/completions", data=data,
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == status
            error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param


async def test_bad_completion_requests_and_unknown_routes(mesh, client):
    async with aiohttp.ClientSession() as session:
        for body, param in (({"model": MODEL}, "prompt"), ({"model": MODEL, "prompt": [1, "x"]}, "prompt"),
                            ({"model": MODEL, "prompt": [10**7]}, "prompt"),
                            ({"model": MODEL, "prompt": ""}, "prompt")):
            async with session.post(f"{mesh.head.url}/v1/completions", json=body) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == param
        async with session.get(f"{mesh.head.url}/v1/engines") as response:
            assert response.status == 404
            assert "no route" in (await response.json())["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=30)
    # The head keeps serving after every bad request.
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3).usage.completion_tokens == 3


async def test_ws_chat_streams_stops_and_chats_twice_on_one_socket(mesh):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{mesh.head.ws_url}/ws/chat") as ws:
            await ws.send_json({"type": "chat", "messages": QUESTION, "max_tokens": 16, "temperature": 0, "id": "t1"})
            start = await ws.receive_json()
            assert start["type"] == "start" and start["id"] == "t1" and start["prompt_tokens"] > 10
            deltas = []
            while (message := await ws.receive_json())["type"] == "delta":
                deltas.append(message["text"])
            assert message["type"] == "done" and message["id"] == "t1"
            assert message["finish_reason"] == "length" and len(deltas) > 3
            assert message["text"] == "".join(deltas)
            assert message["usage"]["completion_tokens"] == 16
            assert message["timing"]["ttft_ms"] > 0 and message["timing"]["tokens_per_second"] > 0
            assert [hop["layers"] for hop in message["route"]] == [[0, 15], [15, 30]]

            # Second turn on the same socket, stopped mid-way.
            history = QUESTION + [{"role": "assistant", "content": message["text"]},
                                  {"role": "user", "content": "Now tell me a very long story about it."}]
            await ws.send_json({"type": "chat", "messages": history, "max_tokens": 500, "temperature": 0})
            assert (await ws.receive_json())["type"] == "start"
            for _ in range(3):
                assert (await ws.receive_json())["type"] == "delta"
            assert mesh.tail.health()["sessions"] == 1
            await ws.send_json({"type": "stop"})
            while (message := await ws.receive_json())["type"] == "delta":
                pass
            assert message["type"] == "done" and message["finish_reason"] == "stopped"
            assert message["usage"]["completion_tokens"] < 500
            assert mesh.tail.wait_sessions(0)["sessions"] == 0

            await ws.send_json({"type": "dance"})
            assert "unknown message type" in (await ws.receive_json())["message"]
            await ws.send_json({"type": "chat", "messages": []})
            assert (await ws.receive_json())["type"] == "error"
            await ws.send_json({"type": "chat", "messages": QUESTION, "max_tokens": 2})
            assert (await ws.receive_json())["type"] == "start"


@pytest.mark.parametrize("form", ["{ws}", "{ws}/ws/chat", "http://{host}:{port}/"])
def test_example_ws_client_streams_an_answer(mesh, form):
    """The terminal client takes the head as people copy it: the page's /ws/chat URL, the API's http:// one."""
    url = form.format(ws=mesh.head.ws_url, host=mesh.head.host, port=mesh.head.port)
    result = subprocess.run(
        [sys.executable, "examples/ws_client.py", "--url", url, "--max-tokens", "8", "--temperature", "0",
         "What is the capital of France?"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr


async def test_api_key_guards_the_api_but_not_health():
    tail_backend = CachedTailBackend([(" a", 1), ("", 99)])
    async with fake_mesh(CachedHeadBackend(), tail_backend, api_key="sekrit") as fake:
        url = f"http://127.0.0.1:{fake.head_port}"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                    assert response.status == 401
                    assert (await response.json())["error"]["code"] == "invalid_api_key"
            for path in ("/tokenize", "/detokenize", "/v1/tokenize"):  # the tokenizer is the API's too
                async with session.post(f"{url}{path}", json={"prompt": "hi", "tokens": [1]}) as response:
                    assert response.status == 401, path
            async with session.get(f"{url}/health") as response:
                assert response.status == 200
        # a key that is not UTF-8 (raw bytes on the wire) is a wrong key: 401, not a 500 and a logged traceback
        for path, status in ((b"/v1/models", b"401"), (b"/health", b"200")):  # (/health: the plain view)
            reader, writer = await asyncio.open_connection("127.0.0.1", fake.head_port)
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"X-Forwarded-For: 203.0.113.9\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
        keyed = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0)
        answer = await keyed.chat.completions.create(model="fake-model", messages=body["messages"])
        assert answer.choices[0].message.content == " a"
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()


def test_the_responses_api_answers_as_chat_calls_tools_and_streams_typed_events(client):
    """POST /v1/responses with the official client: the same greedy text as chat for the same messages, a
    forced function call as a function_call item whose result fed back gets an answer, a json_schema answer, the
    typed stream events in order (numbered) carrying the same text, and stored-response fields refused."""
    import json

    import jsonschema

    ask = "What is the weather like in Paris?"
    answer = client.responses.create(model=MODEL, instructions="Answer briefly.", input=ask, max_output_tokens=12,
                                     temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ask}])
    assert answer.output_text == chat.choices[0].message.content and answer.output[0].type == "message"
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert answer.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # A function tool in the flat shape, forced; its call and result fed back as items.
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
              "parameters": LAX_TOOLS[0]["function"]["parameters"]}]
    called = client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                     max_output_tokens=60, temperature=0)
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), dict(tools[0]["parameters"], additionalProperties=False))
    final = client.responses.create(model=MODEL, tools=tools, max_output_tokens=30, temperature=0, input=[
        {"role": "user", "content": ask}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "celsius": 21}'}])
    assert final.output_text and final.output[0].type == "message"
    person = client.responses.create(model=MODEL, input="Invent a person. Answer in JSON.", max_output_tokens=60,
                                     temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                     "schema": LAX_PERSON, "strict": True}})
    jsonschema.validate(json.loads(person.output_text), LAX_PERSON)
    # Streamed: typed events, numbered in order, the same text and usage as the whole answer.
    events = list(client.responses.create(model=MODEL, instructions="Answer briefly.", input=ask,
                                          max_output_tokens=12, temperature=0, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{answer.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
    assert events[-1].response.output_text == answer.output_text
    assert events[-1].response.usage.output_tokens == answer.usage.output_tokens
    streamed_call = [e for e in client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                                        max_output_tokens=60, temperature=0, stream=True)
                     if e.type == "response.function_call_arguments.done"]
    assert len(streamed_call) == 1 and streamed_call[0].arguments == call.arguments
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                         ({"frobnicate": 1}, "frobnicate")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input=ask, extra_body=extra)
        assert caught.value.body["param"] == param


def test_lm_evaluation_harness_request_shapes_score_and_generate_as_the_whole_model(client, tokenizer,
                                                                                  reference_model):
    """The bodies lm-eval's local-completions sends (its _create_payload, tokenized prompts in a batch):
    loglikelihood (echo, logprobs 1, max_tokens 1) scores every prompt token as transformers' float32 model
    within 1e-4 on this float32 mesh, one choice per prompt in order; generate_until ([[ids]], stop, seed)
    gives the greedy continuation."""
    import torch

    from helpers import golden

    texts = ["The capital of France is Paris.", "Water boils at one hundred degrees."]
    batch = [tokenizer(text)["input_ids"] for text in texts]
    scored = client.completions.create(model=MODEL, prompt=batch, temperature=0, max_tokens=1, logprobs=1,
                                       seed=1234, echo=True)
    assert [choice.index for choice in scored.choices] == [0, 1]
    for ids, choice in zip(batch, scored.choices):
        with torch.inference_mode():
            want = torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        got = torch.tensor(choice.logprobs.token_logprobs[1:len(ids)])
        assert torch.allclose(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)
    generated = client.completions.create(model=MODEL, prompt=[batch[0]], max_tokens=8, temperature=0,
                                          stop=["\n\n"], seed=1234)
    assert len(generated.choices) == 1
    assert generated.choices[0].text == tokenizer.decode(golden(reference_model, batch[0], 8)).split("\n\n")[0]
