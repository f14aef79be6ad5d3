"""Tools (function calling): the request's `tools` and `tool_choice`, their place in the prompt, and the calls
read back out of the answer.

A model whose chat template renders tools gets them that way; the others (SmolLM2's
template knows none) get them the way Hermes-style templates do: a system block listing
the functions as JSON and asking for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
earlier calls and their results go back into the conversation in the same form. With
`tool_choice` `required` or a named function, the answer is sampled under a grammar
(`model.constraints`, compiled once the request is admitted: `head.grammars`) that only
allows such a call — one call, to one of the functions, with arguments valid against its
`parameters` — so it always parses. With `auto` the
model chooses: a `<tool_call>` block in its text becomes a call; with `none`, none is read.
"""

from __future__ import annotations

import json
import re
import uuid

import orjson
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024  # a response_format's schema, or all of a request's tools
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.S)


@dataclass
class ToolSpec:
    functions: list[dict[str, Any]]  # {"name", "description"?, "parameters"?}
    choice: str = "auto"  # auto, none, required, or "function" with `name`
    name: str | None = None
    schema: dict[str, Any] | None = None  # required / named: the answer is one call, valid against this

    @property
    def forced(self) -> bool:
        return self.schema is not None

    def system_block(self) -> str:
        """The tools as a system message says them (for templates that do not render tools)."""
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.functions)
        return (f"You may call these functions:\n<tools>\n{listed}\n</tools>\nTo call one, answer with only\n"
                f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')


def check_schema_size(schema: Any, param: str) -> None:
    """A schema (or tools' schemas) meshws compiles: at most MAX_SCHEMA_BYTES as JSON, and not absurdly deep."""
    try:
        size = len(orjson.dumps(schema))
    except (TypeError, ValueError, RecursionError):  # orjson refuses nesting beyond 255 levels
        size = MAX_SCHEMA_BYTES + 1
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"'{param}': schemas of at most {MAX_SCHEMA_BYTES} bytes of JSON, nested less deeply "
                       "than 255 levels", param=param, code="invalid_value")


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} functions", param="tools",
                       code="invalid_value")
    check_schema_size(tools, "tools")
    functions = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not NAME.match(function["name"]):
            raise ApiError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": "
                           "[A-Za-z0-9_-]{1,64}, ...}}", param=where, code="invalid_value")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or not isinstance(function.get("description", ""), str):
            raise ApiError(400, f"'{where}.function' parameters must be a JSON schema object and the description "
                           "a string", param=where, code="invalid_value")
        functions.append({key: function[key] for key in ("name", "description", "parameters") if key in function})
    names = [f["name"] for f in functions]
    spec = ToolSpec(functions)
    if choice in (None, "auto", "none", "required"):
        spec.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) and choice["function"].get("name") in names:
        spec.choice, spec.name = "function", choice["function"]["name"]
    else:
        raise ApiError(400, "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                       "{\"name\": <one of the tools>}}", param="tool_choice", code="invalid_value")
    if spec.choice in ("required", "function"):
        chosen = [f for f in functions if spec.name in (None, f["name"])]
        spec.schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                                  "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters", {"type": "object"})}}
                                 for f in chosen]}
    return spec


def calls_in(text: str, spec: ToolSpec) -> tuple[str, list[dict[str, Any]]]:
    """The answer's text before its calls, and the calls (OpenAI's `tool_calls`); none when the choice is none."""
    if spec.choice == "none":
        return text, []
    if spec.forced:  # the grammar made the whole answer one call
        found = [text]
        before = ""
    else:
        found = CALL.findall(text)
        before = text.split(OPEN, 1)[0] if found else text
    calls = []
    names = {f["name"] for f in spec.functions}
    for raw in found:
        try:
            call = json.loads(raw)
            if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}),
                                                                                      dict)):
                continue
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        except (ValueError, RecursionError):  # the model's text: anything may come
            continue
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    return (before.rstrip() if calls else text), calls


def call_text(tool_calls: list[dict[str, Any]]) -> str:
    """Earlier calls of the assistant, as the prompt gives them back to the model."""
    parts = []
    for call in tool_calls:
        function = call["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
            json.dumps(arguments)
        except (ValueError, RecursionError):
            arguments = function.get("arguments")
        parts.append(f"{OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CLOSE}")
    return "\n".join(parts)


@dataclass
class CallSplitter:
    """Streamed text of an `auto` answer: what can go out as content before a call (which is held back)."""

    held: str = ""
    in_call: bool = False
    withheld: str = ""  # from the start of a call on: content after all if no call parses

    def feed(self, delta: str) -> str:
        if self.in_call:
            self.withheld += delta
            return ""
        self.held += delta
        if OPEN in self.held:
            self.in_call = True
            out, rest = self.held.split(OPEN, 1)
            self.held, self.withheld = "", OPEN + rest
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                     if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def rest(self, called: bool) -> str:
        """At the end: what was held back and is no call after all (all of it when no call parsed)."""
        out = "" if called else self.held + self.withheld
        self.held = self.withheld = ""
        return out


def plain_messages(messages: list[dict[str, Any]], spec: ToolSpec | None) -> list[dict[str, str]]:
    """Messages for a template that renders no tools: the tools in a system message, earlier calls and their
    results as text, the way Hermes-style templates put them."""
    plain = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content = (content + "\n" if content else "") + call_text(message["tool_calls"])
        if message["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        plain.append({"role": message["role"], "content": content})
    if spec is not None and spec.choice != "none":
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + spec.system_block()}
        else:
            plain.insert(0, {"role": "system", "content": spec.system_block()})
    return plain
