"""Tools: the request's tools and choice, the prompt's tool block, and the calls read back out of an answer."""

import json

import pytest

from meshws.api.errors import ApiError
from meshws.api.tools import CallSplitter, calls_in, parse_tools, plain_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def test_required_and_named_choices_come_with_a_grammar_auto_and_none_without():
    assert parse_tools({"tools": [WEATHER]}).choice == "auto" and not parse_tools({"tools": [WEATHER]}).forced
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).forced
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.choice == "function" and named.name == "get_weather" and named.forced
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "none"}) is None
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"), ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]"),
                        ({"tools": "all"}, "tools"), ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(ApiError) as caught:
            parse_tools(body)
        assert caught.value.param == param


def test_calls_are_read_from_the_answer_and_the_text_before_them_kept():
    auto = parse_tools({"tools": [WEATHER]})
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = calls_in(text, auto)
    assert content == "Let me check." and len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[0]["function"]["arguments"]) == \
        {"city": "Oslo"}
    assert calls_in('<tool_call>{"name": "other", "arguments": {}}</tool_call>', auto)[1] == []  # not a tool
    assert calls_in("just text", auto) == ("just text", [])
    forced = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert calls_in('{"name": "get_weather", "arguments": {"city": "Rome"}}', forced)[1][0]["function"]["name"] \
        == "get_weather"
    assert calls_in(text, parse_tools({"tools": [WEATHER], "tool_choice": "none"}))[1] == []


def test_a_stream_holds_back_what_may_start_a_call():
    splitter = CallSplitter()
    out = [splitter.feed(piece) for piece in ("Sure", " <tool", "_call>", '{"name"', "}")]
    assert out == ["Sure", " ", "", "", ""] and splitter.rest(called=True) == ""
    splitter = CallSplitter()
    assert splitter.feed("a <to") == "a " and splitter.feed("ast") == "<toast" and splitter.rest(False) == ""
    splitter = CallSplitter()  # a call that never parses: its text is content after all
    assert splitter.feed("x <tool_call>{broken") == "x " and splitter.rest(called=False) == "<tool_call>{broken"
    forced = CallSplitter(in_call=True)  # a required call cut short by max_tokens: the text is not lost
    assert forced.feed('{"name": "get_we') == "" and forced.rest(called=False) == '{"name": "get_we'


def test_deep_nesting_in_model_output_or_schemas_is_a_400_or_no_call_never_a_crash():
    deep = "[" * 5000 + "]" * 5000
    auto = parse_tools({"tools": [WEATHER]})
    assert calls_in(f'<tool_call>{{"name": "get_weather", "arguments": {{"a": {deep}}}}}</tool_call>', auto)[1] == []
    nested = {"type": "object"}
    for _ in range(1000):
        nested = {"type": "object", "properties": {"a": nested}}
    with pytest.raises(ApiError) as caught:
        parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested}}]})
    assert caught.value.param == "tools"


def test_templates_without_tools_get_them_as_a_system_block_and_calls_as_text():
    spec = parse_tools({"tools": [WEATHER]})
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    plain = plain_messages(messages, spec)
    assert plain[0]["role"] == "system"
    assert "get_weather" in plain[0]["content"] and "<tool_call>" in plain[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == plain[2]["content"]
    assert plain[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
