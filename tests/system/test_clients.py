"""The clients people already use, unchanged, against one float32 head + tail: lm-evaluation-harness's
local-completions, LangChain's ChatOpenAI, pydantic-ai's Agent and the OpenAI Agents SDK (its default Responses
model). The embedded model is tiny, so the tests check structure (a parsed object, a tool called with valid
arguments, a final answer), and lm-eval's numbers against its own `hf` backend on the same weights."""

import json
from pathlib import Path

import pytest

from helpers import MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

TASKS = Path(__file__).parent / "eval_tasks"  # lm-eval task YAMLs and their local dataset
WEATHER = "It is sunny and 21 degrees in {city}."


@pytest.fixture(scope="module")
def base_url(mesh):
    return f"{mesh.head.url}/v1"


def _evaluate(model, model_args):
    """lm-eval's Python API on the two local tasks; each task's logged samples by doc_id."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)  # (indexing lm-eval's own: seconds)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["meshws_choice", "meshws_generate"],
                                  task_manager=tasks, log_samples=True)
    return {task: {sample["doc_id"]: sample["resps"] for sample in samples}
            for task, samples in out["samples"].items()}


def test_lm_evaluation_harness_scores_and_generates_as_its_own_hf_backend(base_url, embedded_model,
                                                                          embedded_folder, monkeypatch):
    """`local-completions` with its default arguments (token-id prompts, batch size 1) against the head, and
    lm-eval's `hf` backend on the same float32 weights, offline: every choice's loglikelihood within 1e-4, the
    same is-greedy flags, the same greedy generations."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS)  # the tasks' data_files
    served = _evaluate("local-completions", {"base_url": f"{base_url}/completions", "model": MODEL,
                                             "tokenizer": str(embedded_model.folder)})
    reference = _evaluate("hf", {"pretrained": str(embedded_folder.folder), "dtype": "float32", "device": "cpu"})

    documents = len((TASKS / "questions.jsonl").read_text().splitlines())
    choices, want = served["meshws_choice"], reference["meshws_choice"]
    assert sorted(choices) == sorted(want) == list(range(documents))
    differences = []
    for doc_id, responses in want.items():
        assert len(choices[doc_id]) == len(responses) == 3
        for (got_score, got_greedy), (want_score, want_greedy) in zip((r[0] for r in choices[doc_id]),
                                                                      (r[0] for r in responses)):
            differences.append(abs(got_score - want_score))
            assert got_greedy == want_greedy
    assert max(differences) < 1e-4, f"largest loglikelihood difference {max(differences):.2e}"

    generations = {doc_id: responses[0][0] for doc_id, responses in served["meshws_generate"].items()}
    assert generations == {doc_id: responses[0][0] for doc_id, responses in reference["meshws_generate"].items()}
    assert len(generations) == documents and all(generations.values())


@pytest.fixture(scope="module")
def chat_model(base_url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=60,
                      max_retries=0, timeout=120)


def _city_model():
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and the country it is in."""

        name: str = Field(description="the city's name")
        country: str

    return City


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_parses(chat_model, method):
    """with_structured_output by json_schema (response_format) and by function calling (a forced tool): the
    answer finishes within 60 tokens and parses into the pydantic model."""
    city = _city_model()
    answer = chat_model.with_structured_output(city, method=method, include_raw=True).invoke(
        "Name the capital of France and its country.")
    assert answer["parsing_error"] is None and isinstance(answer["parsed"], city)
    assert answer["parsed"].name and answer["parsed"].country
    raw = answer["raw"]
    if method == "function_calling":
        assert [call["name"] for call in raw.tool_calls] == ["City"]
        assert raw.response_metadata["finish_reason"] == "tool_calls"
    else:
        assert raw.response_metadata["finish_reason"] == "stop" and not raw.tool_calls


def test_langchain_bound_tool_result_goes_back_for_a_final_answer(chat_model, tokenizer):
    """bind_tools: a call to the named tool with arguments its schema takes, its result sent back as a
    ToolMessage, then an answer in text that calls nothing."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return WEATHER.format(city=city)

    conversation = [HumanMessage("What is the weather in Paris?")]
    asked = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(conversation)
    assert [call["name"] for call in asked.tool_calls] == ["get_weather"]
    arguments = asked.tool_calls[0]["args"]
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and arguments["city"]
    result = get_weather.invoke(arguments)
    conversation += [asked, ToolMessage(result, tool_call_id=asked.tool_calls[0]["id"])]
    final = chat_model.bind_tools([get_weather]).invoke(conversation)
    assert final.response_metadata["finish_reason"] == "stop" and not final.tool_calls and final.content
    # The call and its result were in the second prompt: it grew by at least the result's tokens.
    grown = final.usage_metadata["input_tokens"] - asked.usage_metadata["input_tokens"]
    assert grown >= len(tokenizer(result)["input_ids"])


def test_langchain_streams_the_answer_it_invokes(chat_model):
    """stream (with usage): several chunks, which join into the greedy answer invoke gives, with its usage."""
    question = "Say hello to a new colleague."
    whole = chat_model.invoke(question)
    chunks = list(chat_model.stream(question, stream_usage=True))
    assert sum(1 for chunk in chunks if chunk.content) > 1
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined += chunk
    assert joined.content == whole.content and whole.content
    assert joined.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"]


def test_pydantic_ai_agent_calls_its_tool_then_gives_its_output_type(base_url):
    """An Agent with a pydantic output type and a tool (tool_choice set per step, as pydantic-ai documents):
    the tool runs with valid arguments, its result goes back, and the run ends in a valid output object."""
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: str
        degrees: int = Field(description="the temperature in degrees Celsius")

    def settings(context):  # the tool at the first step, then the final result
        tools = ["get_weather"] if context.run_step == 1 else ["final_result"]
        return ModelSettings(temperature=0, max_tokens=60, tool_choice=tools)

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(model, output_type=Weather, model_settings=settings,
                  instructions="Answer with the weather get_weather reports.")
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return WEATHER.format(city=city)

    result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, Weather) and result.output.city
    assert len(cities) == 1 and cities[0]
    called = [part.tool_name for message in result.all_messages() for part in message.parts
              if isinstance(part, ToolCallPart)]
    assert called == ["get_weather", "final_result"] and result.usage.requests == 2


async def test_openai_agents_sdk_runs_a_function_tool_on_the_responses_api(base_url):
    """The Agents SDK's default model (OpenAIResponsesModel: /v1/responses) with a function tool: the tool is
    called with valid arguments, its output goes back, and a final text answer arrives; tracing off."""
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120))
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return WEATHER.format(city=city)

    agent = Agent(name="weather", instructions="Answer questions about the weather.", model=MODEL,
                  tools=[get_weather], model_settings=ModelSettings(temperature=0, max_tokens=60,
                                                                    tool_choice="required"))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    call = result.new_items[0].raw_item
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and set(arguments) == {"city"} and cities == [arguments["city"]]
    assert isinstance(result.final_output, str) and result.final_output
    # Both model calls went to /v1/responses (its ids; the chat-completions model records none).
    assert len(result.raw_responses) == 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)
