"""Validating a request body (OpenAI fields) into a `CompletionSpec`, the same for chat,
completions and `/ws/chat`. Every refusal is an `ApiError` naming the field in `param`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from ..head.service import HeadService
import orjson

from ..model.text.constraints import GrammarError
from ..model.text.sampling_params import MAX_PROMPT_LOGPROBS, MAX_PROMPT_TOP_LOGPROBS, MAX_TOP_LOGPROBS, SamplingParams
from .errors import ApiError, shown
from .fields import check_fields
from .messages import MAX_MESSAGES, message_chars, parse_messages
from .tools import ToolSpec, check_schema_size, parse_tools, plain_messages

MAX_CHOICES = 8  # `n`
CHARS_PER_TOKEN_CAP = 16  # a prompt longer than context x this many characters cannot fit: refused unread
DEFAULT_MAX_TOKENS = 1024
MAX_LOGPROB_ENTRIES = 1 << 17  # in a whole (not streamed) answer: each a token's text, decoded on the loop
MAX_STOP_STRINGS = 16
MAX_USER_CHARS = 256  # 'user' (an end user's id: part of a warm session's owner, echoed by /v1/responses)
MAX_STOP_CHARS = 256  # each (the text held back for stop strings, checked on every token, stays small)
MAX_BATCH = 64  # a completion's prompts times `n`: each is a generation, queued for a slot of its own
BATCH_CONTEXTS = 8  # all of a batch's prompts together: at most this many context windows of tokens


@dataclass
class CompletionSpec:
    """A validated request, the same for chat, completions and /ws/chat."""

    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True  # llama-server's field: false keeps the request out of the warm pool
    owner: str = ""  # who may adopt this request's warm session later: the same client address and `user`
    cache_salt: str = ""  # vLLM's field: shared prompt prefixes serve requests of the same salt only
    model: str = ""  # the name the request called the model by (answers echo it)
    tools: ToolSpec | None = None  # chat: the functions the model may call (the answer's calls are read back)
    echo: bool = False  # a completion's text starts with its prompt
    n: int = 1  # choices (they share the prompt's prefill)


# -- validation ---------------------------------------------------------------


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", param=name, code="invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name, code="invalid_value")
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, default: int | None,
             high: int = 2**62) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name, code="invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name,
                       code="invalid_value")
    return value


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0) or 0,
        repetition_penalty=_number(body, "repetition_penalty", 0.01, 10.0, 1.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        seed=_integer(body, "seed", -(2**62), None),
    )


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no log-probabilities.

    Chat: `logprobs: true` and `top_logprobs` 0-20; completions: `logprobs` 0-20 (OpenAI's is 0-5).
    """
    if not chat:
        wanted = _integer(body, "logprobs", 0, None, high=MAX_TOP_LOGPROBS)
        if body.get("echo") and wanted is not None and wanted > MAX_PROMPT_TOP_LOGPROBS:
            raise ApiError(400, f"with 'echo', 'logprobs' is at most {MAX_PROMPT_TOP_LOGPROBS}", param="logprobs",
                           code="invalid_value")
        return wanted
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "'logprobs' must be a boolean", param="logprobs", code="invalid_type")
    top = _integer(body, "top_logprobs", 0, None, high=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format` as the JSON schema the answer must follow (None: free text), compiled into the grammar the
    tail samples under once the request is admitted (`complete_spec`)."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    schema = None
    if kind == "json_schema":
        inner = spec.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format", code="invalid_value")
    elif kind != "json_object":
        raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       param="response_format", code="invalid_value")
    check_schema_size(schema, "response_format")
    return schema if schema is not None else {"type": "object"}


def parse_stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop", code="invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"each 'stop' string takes at most {MAX_STOP_CHARS} characters", param="stop",
                       code="invalid_value")
    return [s for s in stop if s]


def check_common(body: dict[str, Any], chat: bool) -> None:
    check_fields(body, chat)
    for name in ("stream", "return_token_ids", "ignore_eos", "cache_prompt", "echo"):
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise ApiError(400, f"'{name}' must be a boolean", param=name, code="invalid_type")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls",
                       code="invalid_type")
    for name in ("user", "cache_salt"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
            raise ApiError(400, f"'{name}' must be a string of at most {MAX_USER_CHARS} characters", param=name,
                           code="invalid_value")
    options = body.get("stream_options")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if options is not None and not isinstance(usage, bool):
        raise ApiError(400, "'stream_options' must be an object with a boolean include_usage",
                       param="stream_options", code="invalid_type")


@dataclass
class RequestDraft:
    """A request whose fields are checked, before any work is spent on its prompt."""

    body: dict[str, Any]
    chat: bool
    sampling: SamplingParams
    stop: list[str]
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str = ""  # completions: the text ...
    prompt_ids: list[int] | None = None  # ... or the token ids
    batch: list[tuple[str, list[int] | None]] = field(default_factory=list)  # completions: several prompts
    tools: ToolSpec | None = None  # chat: the functions the model may call
    schema: dict[str, Any] | None = None  # chat: the schema `response_format` asks the answer to follow


def check_request(body: dict[str, Any], chat: bool, head: HeadService) -> RequestDraft:
    """Every check that needs no template and no tokenizer: cheap, so it runs before admission."""
    check_common(body, chat)
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is a required field", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
    if model not in head.served_names:
        served = " or ".join(repr(name) for name in head.served_names)
        raise ApiError(404, f"the model {shown(model)} does not exist; this mesh serves {served}", param="model",
                       code="model_not_found")
    logprobs = parse_logprobs(body, chat)
    tools = parse_tools(body) if chat else None
    schema = parse_response_format(body) if chat else None
    if schema is not None and tools is not None and tools.forced:
        raise ApiError(400, "'response_format' and a required tool call cannot both shape the answer",
                       param="response_format", code="invalid_value")
    sampling = replace(parse_sampling(body), logprobs=logprobs,
                       prompt_logprobs=bool(body.get("echo")) and logprobs is not None)
    if (schema is not None or (tools is not None and tools.forced)) and body.get("ignore_eos"):
        raise ApiError(400, "'ignore_eos' cannot go past the end of a structured answer", param="ignore_eos",
                       code="invalid_value")
    draft = RequestDraft(body, chat, sampling, parse_stop(body), tools=tools, schema=schema)
    if chat:
        draft.messages = parse_messages(body)
        tool_chars = len(orjson.dumps(tools.functions)) if tools is not None else 0  # (listed in the prompt too)
        _check_size(sum(message_chars(m) for m in draft.messages) + tool_chars, len(draft.messages),
                    head.context_length)
    else:
        prompts = _completion_prompts(body)
        for text, ids in prompts:
            _check_size(len(text) + len(ids or ()), 1, head.context_length)
        if sum(len(text) / CHARS_PER_TOKEN_CAP + len(ids or ()) for text, ids in prompts) > batch_tokens(head):
            raise ApiError(400, f"the prompts together are longer than {BATCH_CONTEXTS} context windows could hold",
                           param="prompt", code="context_length_exceeded")
        draft.prompt, draft.prompt_ids = prompts[0]
        draft.batch = prompts if len(prompts) > 1 else []
    wanted = [_integer(body, name, 1, None) for name in ("max_completion_tokens", "max_tokens")]  # (checked now)
    streamed_extras = logprobs is not None or body.get("echo") or (tools is not None and tools.choice != "none")
    n = _integer(body, "n", 1, 1, high=MAX_CHOICES) or 1
    if len(draft.batch) * n > MAX_BATCH:
        raise ApiError(400, f"at most {MAX_BATCH} prompts times 'n' per request, got {len(draft.batch)} x {n}",
                       param="prompt", code="invalid_value")
    if logprobs is not None and not body.get("stream") and max(1, len(draft.batch)) * n * (logprobs + 1) * min(
            wanted[0] or wanted[1] or DEFAULT_MAX_TOKENS, head.context_length) > MAX_LOGPROB_ENTRIES:  # (built at once)
        raise ApiError(400, f"a whole answer carries at most {MAX_LOGPROB_ENTRIES} log-probabilities (prompts x 'n' x "
                       "tokens x (1 + alternatives)): ask for fewer, or stream", param="logprobs", code="invalid_value")
    if (n > 1 or draft.batch) and body.get("stream") and streamed_extras:
        raise ApiError(400, "with 'n' > 1 or several prompts a stream carries text only: ask without stream for "
                       "log-probabilities, echo or tool calls", param="n" if n > 1 else "prompt",
                       code="unsupported_parameter")
    return draft


async def complete_spec(draft: RequestDraft, head: HeadService) -> CompletionSpec:
    """The prompt of an admitted request templated and tokenized, and the checks that need its length."""
    body, chat, stop = draft.body, draft.chat, list(draft.stop)
    schema = draft.schema if draft.schema is not None else draft.tools.schema if draft.tools is not None else None
    if schema is not None:  # (compiled now, admitted: off the event loop, a few at a time, within a budget)
        param = "response_format" if draft.schema is not None else "tools"
        try:
            draft = replace(draft, sampling=replace(draft.sampling, grammar=await head.grammars.compile(schema)))
        except GrammarError as exc:
            raise ApiError(400, f"'{param}': {str(exc)[:300]}", param=param, code="invalid_value") from None
    builder = head.prompts
    prompt, prompt_ids = draft.prompt, draft.prompt_ids
    if draft.messages is not None:
        tools, messages = draft.tools, draft.messages
        native = builder.renders_tools and tools is not None  # the template lays the tools out itself
        if not native:
            messages = plain_messages(messages, tools)
        rendered = [{"type": "function", "function": f} for f in tools.functions] if native and tools else None
        try:
            prompt = await asyncio.to_thread(builder.chat_prompt, messages, rendered)
        except Exception as exc:  # a model's Jinja template may raise on messages it does not expect
            raise ApiError(400, f"the model's chat template cannot render these messages: {str(exc)[:200]}",
                           param="messages", code="invalid_value") from None
        if not builder.has_template:
            stop += builder.DEFAULT_STOP
    if prompt_ids is None:
        prompt_ids = await head.tokenize(prompt)
    context = head.context_length
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt" if not chat else "messages", code="invalid_value")
    vocab = head.vocab_size
    if vocab and max(prompt_ids) >= vocab:
        raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt",
                       code="invalid_value")
    if len(prompt_ids) >= context:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context window is {context}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    if draft.sampling.prompt_logprobs and len(prompt_ids) > MAX_PROMPT_LOGPROBS + 1:
        raise ApiError(400, f"'echo' with 'logprobs' takes prompts of at most {MAX_PROMPT_LOGPROBS + 1} tokens",
                       param="echo", code="invalid_value")
    max_tokens = _integer(body, "max_completion_tokens", 1, None)
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _integer(body, "max_tokens", 1, None), "max_tokens"
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, context - len(prompt_ids))
    elif max_tokens > context:
        raise ApiError(400, f"'{name}' is {max_tokens}; this node allows at most {context}",
                       param=name, code="invalid_value")
    elif len(prompt_ids) + max_tokens > context:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + '{name}' ({max_tokens}) exceeds the "
                       f"context window of {context} tokens", param=name, code="context_length_exceeded")
    options = body.get("stream_options") or {}
    return CompletionSpec(
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        sampling=draft.sampling,
        stop=stop,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids")),
        ignore_eos=bool(body.get("ignore_eos")),
        cache_prompt=body.get("cache_prompt") is not False and not draft.sampling.prompt_logprobs,  # all prefilled
        echo=bool(body.get("echo")),
        cache_salt=body.get("cache_salt") or "",
        tools=draft.tools,
        n=_integer(body, "n", 1, 1, high=MAX_CHOICES) or 1,
        model=body["model"],
    )


def _completion_prompts(body: dict[str, Any]) -> list[tuple[str, list[int] | None]]:
    """/v1/completions takes a string, a list of token ids, or a list of either: one prompt each, as OpenAI's."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is a required field", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _token_ids(p) for p in prompt):
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of either (one prompt each)",
                       param="prompt", code="invalid_type")
    if len(prompt) > MAX_BATCH:
        raise ApiError(400, f"at most {MAX_BATCH} prompts per request, got {len(prompt)}", param="prompt",
                       code="invalid_value")
    return [(p, None) if isinstance(p, str) else ("", list(p)) for p in prompt]


def batch_tokens(head: HeadService) -> int:
    """The tokens all of a request's prompts may hold together."""
    return head.context_length * BATCH_CONTEXTS


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _check_size(characters: int, messages: int, context: int) -> None:
    """Refuse prompts that cannot fit before spending time on templates and tokenizing."""
    if messages > MAX_MESSAGES:
        raise ApiError(400, f"at most {MAX_MESSAGES} messages per request", param="messages", code="invalid_value")
    if characters > context * CHARS_PER_TOKEN_CAP:
        raise ApiError(400, f"the prompt has {characters} characters; the context window is {context} tokens",
                       param="messages", code="context_length_exceeded")
