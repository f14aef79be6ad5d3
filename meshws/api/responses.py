"""POST /v1/responses, OpenAI's Responses API (the OpenAI Agents SDK's default), over the chat machinery.

A request is translated into a chat request (`as_chat`): `instructions` becomes a system
message, `input` (a string, or items: messages with `input_text` parts, earlier
`function_call`s and their `function_call_output`s) the conversation, `tools` (the flat
`{"type": "function", "name", "parameters"}` shape) and `tool_choice` the chat ones,
`text.format` a `response_format`, `max_output_tokens` `max_tokens`. The chat checks,
admission, templates, grammars and tool parsing then run as for /v1/chat/completions,
and the answer comes back as Responses `output` items: a `message` with `output_text`,
or `function_call`s. Nothing is stored (`store: false`): `previous_response_id` is
refused, so a client sends the whole conversation each time. The route: response_routes.py;
its stream: response_stream.py.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..head.generation import GenerationStats
from .answers import finish_reason
from .errors import ApiError, shown
from .fields import check_response_fields
from .messages import MAX_MESSAGES, MAX_TOOL_CALLS
from .requests import CompletionSpec
from .tools import calls_in


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request stands for (ApiError names the Responses field that is wrong)."""
    check_response_fields(body)
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "responses are not stored here (store: false): send the whole conversation in "
                       "'input' instead of 'previous_response_id'", param="previous_response_id",
                       code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions", code="invalid_type")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("stream", "temperature", "top_p", "user", "parallel_tool_calls", "seed", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise ApiError(400, "'text' must be an object with a 'format'", param="text", code="invalid_type")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input",
                       code="invalid_type")
    if len(items) > MAX_MESSAGES + MAX_TOOL_CALLS:  # (calls in a row become one message: counted as items here)
        raise ApiError(400, f"'input' takes at most {MAX_MESSAGES + MAX_TOOL_CALLS} items", param="input",
                       code="invalid_value")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            messages.append({"role": item["role"], "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                             "content": output if isinstance(output, str) else _content(output, where)})
        else:
            raise ApiError(400, f"'{where}' must be a message, a function_call or a function_call_output item, "
                           f"got type {shown(kind)}", param=where, code="invalid_value")
    return messages


def _text(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"'{where}.{name}' must be a string", param=f"{where}.{name}", code="invalid_type")
    return value


def _content(content: Any, where: str) -> Any:
    """A message's content as chat takes it: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}.content' parts must be input_text or output_text; only text is "
                               "supported", param=f"{where}.content", code="invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content",
                   code="invalid_type")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", param="tools", code="invalid_type")
    chat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not set(tool) <= {"type", "name", "description", "parameters", "strict"}:
            raise ApiError(400, f"'tools[{index}]' must be {{\"type\": \"function\", \"name\", \"description\", "
                           "\"parameters\", \"strict\"}} (only function tools are served)", param=f"tools[{index}]",
                           code="invalid_value")
        chat.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                      if tool.get(key) is not None}})
    return chat


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # auto, none, required (the chat checks refuse anything else)


def _format(fmt: Any) -> dict[str, Any]:
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt  # text, json_object (the chat checks refuse anything else)


def output_items(text: str, spec: CompletionSpec) -> list[dict[str, Any]]:
    """The answer as Responses output: its text as a message, and each tool call as a function_call."""
    content, calls = calls_in(text, spec.tools) if spec.tools is not None else (text, [])
    items = [message_item(content)] if content or not calls else []
    return items + [call_item(call) for call in calls]


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": content}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def response_object(body: dict[str, Any], response_id: str, created: int, status: str,
                    output: list[dict[str, Any]], stats: GenerationStats | None) -> dict[str, Any]:
    """A Response as OpenAI's client reads it; `stats` (the run's figures) once it has ended."""
    incomplete = status == "incomplete"
    tools = [{"strict": None, **tool} for tool in body.get("tools") or []]
    answer: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"), "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None, "store": False, "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0), "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": tools, "truncation": "disabled",
        "metadata": {}, "user": body.get("user"), "usage": None,
    }
    if stats is not None:
        answer["usage"] = {"input_tokens": stats.prompt_tokens,
                           "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                           "output_tokens": stats.completion_tokens,
                           "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": stats.prompt_tokens + stats.completion_tokens}
    return answer


def ended(stats: GenerationStats) -> str:
    """A Response's status: completed, or incomplete when max_output_tokens cut it."""
    return "incomplete" if finish_reason(stats) == "length" else "completed"
