"""Which request fields meshws reads: every field is implemented, refused, or a documented extension.

A client that asks for something meshws does not do (logit biases, stored answers)
gets a 400 naming the field, never an answer that silently ignored it. A field sent
with its "do nothing" value (`logit_bias: {}`, `store: false`, null) is accepted: clients such as the official one,
LangChain or an echoed assistant message send those. An unknown field is refused too, so a typo
(`max_token`) is not a silent default.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError, shown

# Fields meshws implements, per endpoint (the OpenAI names) ...
CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "user", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "n",
}
COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed",
    "stop", "stream", "stream_options", "user", "logprobs", "echo", "n",
}
# ... extensions other servers (vLLM, llama-server) have taught clients to send ...
EXTENSIONS = {
    "top_k": "sample among the k likeliest tokens (0: all)",
    "repetition_penalty": "divide the logits of tokens seen so far (1: off)",
    "return_token_ids": "the answer carries its token ids (and the prompt's)",
    "ignore_eos": "go on past the end of the answer until max_tokens (benchmarks)",
    "cache_prompt": "false keeps the request out of the warm pool and of shared prompt prefixes",
    "cache_salt": "shared prompt prefixes serve only requests with the same salt (vLLM's field)",
}
# ... and OpenAI fields meshws does not implement: accepted only with the value that asks for nothing.
NO_OP = {
    "best_of": (1,),
    "logit_bias": ({},),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),  # one tier here
    "audio": (), "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (),
    "prompt_cache_key": (), "safety_identifier": (),
}
CHAT_ONLY = {"functions", "function_call", "store", "metadata", "modalities", "audio", "prediction", "reasoning_effort",
             "verbosity", "web_search_options", "prompt_cache_key", "safety_identifier", "service_tier"}
COMPLETION_ONLY = {"best_of", "suffix"}

# /v1/responses: the fields it implements, and those it takes only with the value that asks for nothing
RESPONSE_FIELDS = {"model", "input", "instructions", "stream", "max_output_tokens", "temperature", "top_p", "tools",
                   "tool_choice", "text", "previous_response_id", "parallel_tool_calls", "user"}
RESPONSE_NO_OP = {"store": (False,), "metadata": ({},), "include": ([],), "truncation": ("disabled",),
                  "background": (False,), "service_tier": ("auto", "default"), "reasoning": (), "max_tool_calls": (),
                  "top_logprobs": (0,), "prompt_cache_key": (), "safety_identifier": (), "stream_options": ()}

MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id"}  # (the last two checked with the role)
MESSAGE_NO_OP = {"function_call": (), "name": (), "refusal": (),
                 "audio": (), "annotations": ([],), "reasoning_content": ()}


def _is_no_op(value: Any, allowed: tuple[Any, ...]) -> bool:
    return value is None or any(value == ok and type(value) is type(ok) for ok in allowed)


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """Refuse (400, `param` = the field) what this endpoint does not implement or does not know."""
    implemented = CHAT_FIELDS if chat else COMPLETION_FIELDS
    other_only = COMPLETION_ONLY if chat else CHAT_ONLY
    for name, value in body.items():
        if name in implemented or name in EXTENSIONS:
            continue
        if name in NO_OP and name not in other_only:
            if not _is_no_op(value, NO_OP[name]):
                raise ApiError(400, f"'{name}' is not supported by meshws{_asked(value, NO_OP[name])}",
                               param=name, code="unsupported_parameter")
            continue
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        raise ApiError(400, f"unknown field {shown(name)} for {endpoint}; meshws reads "
                       f"{', '.join(sorted(implemented))} and the extensions {', '.join(sorted(EXTENSIONS))}",
                       param=name[:64], code="unknown_parameter")


def check_response_fields(body: dict[str, Any]) -> None:
    """The fields of a /v1/responses request, as `check_fields` checks the others' (nothing is stored here)."""
    for name, value in body.items():
        if name in RESPONSE_FIELDS or name in ("seed", "top_k"):  # (the chat extensions it passes on)
            continue
        if name in RESPONSE_NO_OP:
            if not _is_no_op(value, RESPONSE_NO_OP[name]):
                raise ApiError(400, f"'{name}' is not supported by meshws{_asked(value, RESPONSE_NO_OP[name])}",
                               param=name, code="unsupported_parameter")
            continue
        raise ApiError(400, f"unknown field {shown(name)} for /v1/responses; meshws reads "
                       f"{', '.join(sorted(RESPONSE_FIELDS))}", param=name[:64], code="unknown_parameter")


def check_message_fields(message: dict[str, Any], where: str) -> None:
    """A chat message's fields: role, content, tool_calls and tool_call_id; the others only empty."""
    for name, value in message.items():
        if name in MESSAGE_FIELDS:
            continue
        if name in MESSAGE_NO_OP:
            if not _is_no_op(value, MESSAGE_NO_OP[name]):
                raise ApiError(400, f"'{where}.{name}' is not supported by meshws (no names, function_call "
                               "or audio in messages)", param=f"{where}.{name}", code="unsupported_parameter")
            continue
        raise ApiError(400, f"unknown field {shown(name)} in '{where}'; a message has a role and a content",
                       param=f"{where}.{name[:64]}", code="unknown_parameter")


def _asked(value: Any, allowed: tuple[Any, ...]) -> str:
    """Why a value was refused, for the error message."""
    if not allowed:
        return ""
    shown = " or ".join(repr(ok) for ok in allowed)
    return f"; it accepts only {shown} (null alike)"
