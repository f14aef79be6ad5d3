"""Strict requests: every field is implemented, refused with its name, or a documented extension."""

import pytest

from meshws.api.errors import ApiError
from meshws.api.fields import EXTENSIONS, check_fields, check_message_fields

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field, value, code", [
    ("logit_bias", {"50256": -100}, "unsupported_parameter"),
    ("store", 0, "unsupported_parameter"),  # a number is not the False it equals
    ("store", True, "unsupported_parameter"),
    ("audio", {"voice": "alloy"}, "unsupported_parameter"),
    ("max_token", 5, "unknown_parameter"),  # a typo is not a silent default
    ("suffix", "x", "unknown_parameter"),  # completions only
    ("echo", True, "unknown_parameter"),  # completions only
])
def test_chat_fields_not_implemented_are_refused_by_name(field, value, code):
    with pytest.raises(ApiError) as caught:
        check_fields({**CHAT, field: value}, chat=True)
    assert caught.value.status == 400 and caught.value.param == field and caught.value.code == code


@pytest.mark.parametrize("field, value", [
    ("suffix", "and then"), ("best_of", 3), ("top_logprobs", 2), ("tools", []), ("messages", []),
])
def test_completion_fields_not_implemented_are_refused_by_name(field, value):
    with pytest.raises(ApiError) as caught:
        check_fields({"model": "m", "prompt": "x", field: value}, chat=False)
    assert caught.value.param == field


def test_do_nothing_values_and_extensions_pass():
    check_fields({**CHAT, "n": 1, "tools": [], "tool_choice": "none",
                  "parallel_tool_calls": True, "store": False,
                  "service_tier": "auto", "logit_bias": {}, "user": "u", "seed": 3,
                  **{name: None for name in EXTENSIONS}}, chat=True)
    check_fields({"model": "m", "prompt": "x", "echo": False, "suffix": "", "best_of": 1},
                 chat=False)


def test_message_fields_beyond_role_and_content_are_refused_unless_empty():
    # An assistant message echoed back by a client carries these as nulls: fine.
    check_message_fields({"role": "assistant", "content": "x", "tool_calls": None, "refusal": None,
                          "function_call": None, "audio": None, "annotations": []}, "messages[1]")
    for field, value in (("name", "bob"), ("function_call", {"name": "f"})):
        with pytest.raises(ApiError) as caught:
            check_message_fields({"role": "user", "content": "x", field: value}, "messages[0]")
        assert caught.value.param == f"messages[0].{field}"
    with pytest.raises(ApiError) as caught:
        check_message_fields({"role": "user", "content": "x", "contents": "y"}, "messages[0]")
    assert caught.value.code == "unknown_parameter"


def test_stop_strings_are_bounded_in_number_and_length():
    from meshws.api.requests import MAX_STOP_CHARS, parse_stop

    assert parse_stop({"stop": ["x" * MAX_STOP_CHARS, ""]}) == ["x" * MAX_STOP_CHARS]
    with pytest.raises(ApiError) as caught:
        parse_stop({"stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]})
    assert caught.value.status == 400 and caught.value.param == "stop" and "256 characters" in caught.value.message


@pytest.mark.parametrize("field, value", [
    ("user", "u" * 257), ("user", {"id": 1}), ("parallel_tool_calls", "yes"),
])
def test_fields_echoed_back_or_kept_are_typed_and_bounded(field, value):
    from meshws.api.requests import check_common

    check_common({**CHAT, "user": "u" * 256, "parallel_tool_calls": False}, chat=True)
    with pytest.raises(ApiError) as caught:
        check_common({**CHAT, field: value}, chat=True)
    assert caught.value.status == 400 and caught.value.param == field


def test_a_response_echoes_its_text_format_only():
    from meshws.api.responses import response_object

    body = {"model": "m", "input": "hi", "text": {"format": {"type": "text"}, "padding": "x" * 10000}}
    echoed = response_object(body, "resp_1", 0, "completed", [], None)
    assert echoed["text"] == {"format": {"type": "text"}}
    assert response_object({"model": "m", "input": "hi"}, "resp_1", 0, "completed", [], None)["text"] \
        == {"format": {"type": "text"}}


def test_tool_calls_ids_and_what_the_template_adds_count_toward_a_prompts_size():
    from meshws.api.messages import TEMPLATE_CHARS_PER_CALL as CALL, TEMPLATE_CHARS_PER_MESSAGE as MESSAGE
    from meshws.api.messages import message_chars, parse_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "x" * 5000}}
    empty = {"id": "", "type": "function", "function": {"name": "f", "arguments": ""}}
    messages = parse_messages({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
                                            {"role": "assistant", "content": "", "tool_calls": [empty] * 3}]})
    assert [message_chars(m) for m in messages] == [
        MESSAGE + 2, MESSAGE + CALL + 1 + 5000 + 6, MESSAGE + 2 + 6, MESSAGE + 3 * (CALL + 1)]
    assert CALL >= 45 and MESSAGE >= 10  # an empty call renders about 45 characters (issue 61)


def test_a_whole_answer_bounds_its_log_probabilities():
    from types import SimpleNamespace

    from meshws.api.requests import MAX_LOGPROB_ENTRIES, check_request

    head = SimpleNamespace(served_names=["m"], context_length=8192)
    base = {"model": "m", "prompt": ["a"] * 8, "logprobs": 20, "max_tokens": 64}
    check_request(base, chat=False, head=head)  # 8 x 64 x 21: fine
    check_request({**base, "max_tokens": 8192, "stream": True, "prompt": "a"}, chat=False, head=head)  # streamed
    with pytest.raises(ApiError) as caught:
        check_request({**base, "max_tokens": MAX_LOGPROB_ENTRIES // (8 * 21) + 1}, chat=False, head=head)
    assert caught.value.status == 400 and caught.value.param == "logprobs"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "n": 8}
    check_request({**chat, "max_tokens": 256}, chat=True, head=head)
    with pytest.raises(ApiError):  # the default of 1024 tokens: 8 x 1024 x 21 entries
        check_request(chat, chat=True, head=head)
