"""The OpenAI-compatible HTTP API of a head (or full) node.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models; streaming is
SSE. This file only translates: it validates a request into a
`CompletionSpec`, runs it through `stream_completion`, and shapes the answer
and every error the way the official `openai` client expects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
from aiohttp import web

from .generation import GenerationRequest, GenerationStats, PipelineError
from .sampling import SamplingParams
from .text_stream import stream_completion

log = logging.getLogger("meshws.api")

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 1024
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


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


def _integer(body: dict[str, Any], name: str, low: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name, code="invalid_type")
    if value < low:
        raise ApiError(400, f"'{name}' must be >= {low}, got {value}", param=name, code="invalid_value")
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
    return [s for s in stop if s]


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is a required field", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list", param="messages", code="invalid_type")
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages", code="invalid_value")
    plain: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where, code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"{where}.role", code="invalid_value")
        plain.append({"role": "system" if role == "developer" else role, "content": _content(message, where)})
    return plain


def _content(message: dict[str, Any], where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
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


def check_common(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "'n' must be 1: meshws returns one choice per request", param="n", code="invalid_value")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "'logprobs' is not supported", param="logprobs", code="unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' must be 1", param="best_of", code="invalid_value")
    if body.get("echo") not in (None, False):
        raise ApiError(400, "'echo' is not supported", param="echo", code="unsupported_parameter")
    for name in ("stream", "return_token_ids", "ignore_eos"):
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise ApiError(400, f"'{name}' must be a boolean", param=name, code="invalid_type")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object with a boolean include_usage",
                       param="stream_options", code="invalid_type")


class PromptBuilder:
    """Chat messages -> prompt text and ids, with the model's template or a plain default."""

    DEFAULT_STOP = ["\nUser:"]

    def __init__(self, tokenizer: Any, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.has_template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        lines = []
        for message in messages:
            if message["role"] == "system":
                lines.append(message["content"] + "\n")
            else:
                lines.append(f"{'User' if message['role'] == 'user' else 'Assistant'}: {message['content']}")
        return "\n".join(lines) + "\nAssistant:"


# -- the routes ---------------------------------------------------------------


class OpenAIApi:
    def __init__(self, node: Any) -> None:
        self.node = node  # the head Node: generator, tokenizer worker, model id, settings
        self.created = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)

    async def build_spec(self, body: dict[str, Any], chat: bool) -> CompletionSpec:
        """Validate a request body (OpenAI fields) into a spec; ApiError names what is wrong."""
        check_common(body)
        model = body.get("model")
        if model is None:
            raise ApiError(400, "'model' is a required field", param="model", code="missing_required_parameter")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
        if model != self.node.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this mesh serves '{self.node.model_id}'",
                           param="model", code="model_not_found")
        sampling = parse_sampling(body)
        stop = parse_stop(body)
        builder: PromptBuilder = self.node.prompt_builder
        prompt_ids: list[int] | None = None
        if chat:
            prompt = builder.chat_prompt(parse_messages(body))
            if not builder.has_template:
                stop += builder.DEFAULT_STOP
        else:
            prompt, prompt_ids = _completion_prompt(body)
        if prompt_ids is None:
            prompt_ids = await self.node.worker.call(self.node.backend.tokenize, prompt)
        context = builder.context_length
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt" if not chat else "messages", code="invalid_value")
        vocab = self.node.vocab_size
        if vocab and max(prompt_ids) >= vocab:
            raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt",
                           code="invalid_value")
        if len(prompt_ids) >= context:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context window is {context}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        limit = self.node.max_tokens_limit
        max_tokens = _integer(body, "max_completion_tokens", 1, None)
        name = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, name = _integer(body, "max_tokens", 1, None), "max_tokens"
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, limit, context - len(prompt_ids))
        elif max_tokens > limit:
            raise ApiError(400, f"'{name}' is {max_tokens}; this node allows at most {limit}",
                           param=name, code="invalid_value")
        elif len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + '{name}' ({max_tokens}) exceeds the "
                           f"context window of {context} tokens", param=name, code="context_length_exceeded")
        options = body.get("stream_options") or {}
        return CompletionSpec(
            prompt=prompt,
            prompt_ids=list(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            stream=bool(body.get("stream")),
            include_usage=bool(options.get("include_usage")),
            return_token_ids=bool(body.get("return_token_ids")),
            ignore_eos=bool(body.get("ignore_eos")),
        )

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.node.model_id, "object": "model", "created": self.created, "owned_by": "meshws"}
        return json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_json(request)
            spec = await self.build_spec(body, chat=chat)
            self.node.check_route()
        except ApiError as exc:
            return exc.response()
        kind = "chat.completion" if chat else "text_completion"
        answer_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if spec.stream:
            return await self._stream(request, spec, chat, kind, answer_id)
        return await self._complete(spec, chat, kind, answer_id)

    async def _complete(self, spec: CompletionSpec, chat: bool, kind: str, answer_id: str) -> web.Response:
        stats = GenerationStats(sid=uuid.uuid4().hex)
        token_ids: list[int] = []
        parts: list[str] = []
        try:
            async for delta in self._run(spec, stats, token_ids):
                parts.append(delta)
        except PipelineError as exc:
            if parts or stats.completion_tokens:
                log.warning("generation %s failed after %d tokens: %s", stats.sid[:12], stats.completion_tokens, exc)
            return ApiError(502, f"pipeline error: {exc}", code="pipeline_error", kind="upstream_error").response()
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": stats.finish_reason or "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if spec.return_token_ids:
            choice["token_ids"] = token_ids
        answer = {
            "id": answer_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.node.model_id,
            "choices": [choice],
            "usage": usage(stats),
            "system_fingerprint": None,
        }
        if spec.return_token_ids:
            answer["prompt_token_ids"] = spec.prompt_ids
        return json_response(answer)

    async def _stream(
        self, request: web.Request, spec: CompletionSpec, chat: bool, kind: str, answer_id: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        created = int(time.time())
        chunk_kind = kind + ".chunk" if chat else kind

        def chunk(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": answer_id, "object": chunk_kind, "created": created, "model": self.node.model_id,
                "choices": [choice] if choice is not None else [],
            }
            if extra:
                data.update(extra)
            return b"data: " + orjson.dumps(data) + b"\n\n"

        def delta_choice(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        stats = GenerationStats(sid=uuid.uuid4().hex)
        try:
            if chat:
                await response.write(chunk(delta_choice("", role=True)))
            async for delta in self._run(spec, stats, None):
                await response.write(chunk(delta_choice(delta)))
            await response.write(chunk(delta_choice(None, stats.finish_reason or "length")))
            if spec.include_usage:
                await response.write(chunk(None, {"usage": usage(stats)}))
        except PipelineError as exc:
            error = {"error": {"message": f"pipeline error: {exc}", "type": "upstream_error", "param": None,
                               "code": "pipeline_error"}}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client went away mid-stream; generation %s stopped", stats.sid[:12])
            raise
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _run(self, spec: CompletionSpec, stats: GenerationStats, token_ids: list[int] | None):
        request = GenerationRequest(prompt=spec.prompt, max_tokens=spec.max_tokens, sampling=spec.sampling,
                                    prompt_ids=spec.prompt_ids, ignore_eos=spec.ignore_eos)
        return stream_completion(self.node.generator, request, self.node.decode, spec.stop, stats, token_ids)


def _completion_prompt(body: dict[str, Any]) -> tuple[str, list[int] | None]:
    """/v1/completions takes a string, a one-string list, or a list of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is a required field", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return "", list(prompt)
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                   param="prompt", code="invalid_type")


def usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def error_middleware(api_key: Callable[[], str | None]) -> Any:
    """OpenAI-shaped 401/404/405 for the API routes; the API key check."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        guarded = path.startswith("/v1/") or path == "/ws/chat"
        key = api_key()
        if guarded and key:
            given = request.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else request.query.get("api_key", "")
            import hmac

            if not hmac.compare_digest(token.encode(), key.encode()):
                return ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                code="invalid_api_key").response()
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if not path.startswith("/v1/") or exc.status < 400:
                raise
            message = f"no route {request.method} {path}" if exc.status in (404, 405) else exc.reason
            return ApiError(exc.status, message, code="not_found" if exc.status == 404 else None).response()

    return middleware
