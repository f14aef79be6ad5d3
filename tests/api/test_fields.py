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
