"""Chat messages as a request sends them, checked into plain `{"role", "content"}` dicts (with an assistant's
earlier `tool_calls` or a tool result's `tool_call_id`), the same for chat, /ws/chat and /tokenize.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError, shown
from .fields import check_message_fields

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_CHARS_PER_MESSAGE = 16  # what a chat template adds around a message (role markers), at the least
TEMPLATE_CHARS_PER_CALL = 48  # ... and around a tool call: `<tool_call>{"name": "", "arguments": {}}</tool_call>`
MAX_MESSAGES = 1024
MAX_TOOL_CALLS = 256  # earlier tool calls in one request's messages, all together


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is a required field", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list", param="messages", code="invalid_type")
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages", code="invalid_value")
    if len(messages) > MAX_MESSAGES:  # (before any of them is read)
        raise ApiError(400, f"at most {MAX_MESSAGES} messages per request", param="messages", code="invalid_value")
    calls = sum(len(m["tool_calls"]) for m in messages if isinstance(m, dict) and isinstance(m.get("tool_calls"), list))
    if calls > MAX_TOOL_CALLS:
        raise ApiError(400, f"at most {MAX_TOOL_CALLS} earlier tool calls per request, got {calls}", param="messages",
                       code="invalid_value")
    plain: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where, code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown(role)}",
                           param=f"{where}.role", code="invalid_value")
        check_message_fields(message, where)
        plain.append({"role": "system" if role == "developer" else role, "content": _content(message, where),
                      **_tool_fields(message, where)})
    return plain


def message_chars(message: dict[str, Any]) -> int:
    """A parsed message's characters the template will render: its content, tool calls and tool call id, and what
    the template adds around the message and each call (an empty call still renders its `<tool_call>` block)."""
    calls = message.get("tool_calls") or []
    return TEMPLATE_CHARS_PER_MESSAGE + len(message["content"]) + len(message.get("tool_call_id") or "") + sum(
        TEMPLATE_CHARS_PER_CALL + len(call["function"]["name"]) + len(call["function"].get("arguments", ""))
        + len(str(call.get("id", ""))) for call in calls)


def _tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's earlier `tool_calls`, or a tool result's `tool_call_id` (required on a `tool` message)."""
    role, calls, call_id = message.get("role"), message.get("tool_calls"), message.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(400, f"'{where}.tool_call_id' is required on a tool message", param=f"{where}.tool_call_id",
                           code="invalid_value")
        return {"tool_call_id": call_id}
    if call_id is not None:
        raise ApiError(400, f"'{where}.tool_call_id' belongs on a tool message", param=f"{where}.tool_call_id",
                       code="invalid_value")
    if not calls:
        return {}
    ok = role == "assistant" and isinstance(calls, list) and all(
        isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments", ""), str)
        for c in calls)
    if not ok:
        raise ApiError(400, f"'{where}.tool_calls' must be an assistant's list of {{\"type\": \"function\", "
                       "\"function\": {\"name\", \"arguments\"}}", param=f"{where}.tool_calls", code="invalid_value")
    return {"tool_calls": calls}


def _content(message: dict[str, Any], where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":  # (one that only called tools)
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}.content' parts must be text parts; only text is supported",
                               param=f"{where}.content", code="invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"'{where}.content' must be a string or a list of text parts",
                   param=f"{where}.content", code="invalid_type")
