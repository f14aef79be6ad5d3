"""The OpenAI-compatible HTTP API of a head (or full) node.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models; streaming is
SSE. This file only translates: `requests.build_spec` validates a request into a
`CompletionSpec`, the head admits it and streams its text, and the answer and every
error are shaped the way the official `openai` client expects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from aiohttp import web

from ..head.generation import GenerationRequest, GenerationStats, PipelineError
from ..head.routes import Route
from ..head.service import HeadService, Unavailable
from .errors import ApiError, json_response, public_text, read_json
from .requests import CompletionSpec, build_spec

log = logging.getLogger("meshws.api")


def unavailable(exc: Unavailable) -> ApiError:
    """503 with Retry-After: the head has no room or no route now."""
    return ApiError(503, public_text(str(exc)), code=exc.code, kind="service_unavailable",
                    headers={"Retry-After": str(exc.retry_after)})


def usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def run_spec(head: HeadService, spec: CompletionSpec, stats: GenerationStats, route: Route,
             token_ids: list[int] | None = None) -> AsyncIterator[str]:
    """The text of a validated, admitted request as it is decided."""
    request = GenerationRequest(prompt=spec.prompt, max_tokens=spec.max_tokens, sampling=spec.sampling,
                                prompt_ids=spec.prompt_ids, ignore_eos=spec.ignore_eos)
    return head.stream(request, spec.stop, stats, route, token_ids)


class OpenAIApi:
    def __init__(self, head: HeadService) -> None:
        self.head = head
        self.created = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.head.model_id, "object": "model", "created": self.created, "owned_by": "meshws"}
        return json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            spec = await build_spec(await read_json(request), chat, self.head)
            route = self.head.admit()
        except ApiError as exc:
            return exc.response()
        except Unavailable as exc:
            return unavailable(exc).response()
        kind = "chat.completion" if chat else "text_completion"
        answer_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if spec.stream:
                return await self._stream(request, spec, route, chat, kind, answer_id)
            return await self._complete(spec, route, chat, kind, answer_id)
        finally:
            route.release()  # the generation released it already, unless it never started

    async def _complete(self, spec: CompletionSpec, route: Route, chat: bool, kind: str,
                        answer_id: str) -> web.Response:
        stats = GenerationStats(sid=uuid.uuid4().hex)
        token_ids: list[int] = []
        parts: list[str] = []
        try:
            async for delta in run_spec(self.head, spec, stats, route, token_ids):
                parts.append(delta)
        except PipelineError as exc:
            if parts or stats.completion_tokens:
                log.warning("generation %s failed after %d tokens: %s", stats.sid[:12], stats.completion_tokens, exc)
            return ApiError(502, f"pipeline error: {public_text(str(exc))}", code="pipeline_error",
                            kind="upstream_error").response()
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(stats), "logprobs": None}
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
            "model": self.head.model_id,
            "choices": [choice],
            "usage": usage(stats),
            "system_fingerprint": None,
        }
        if spec.return_token_ids:
            answer["prompt_token_ids"] = spec.prompt_ids
        return json_response(answer)

    async def _stream(self, request: web.Request, spec: CompletionSpec, route: Route, chat: bool, kind: str,
                      answer_id: str) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        created = int(time.time())
        chunk_kind = kind + ".chunk" if chat else kind

        def chunk(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": answer_id, "object": chunk_kind, "created": created, "model": self.head.model_id,
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
            async for delta in run_spec(self.head, spec, stats, route):
                await response.write(chunk(delta_choice(delta)))
            await response.write(chunk(delta_choice(None, _finish(stats))))
            if spec.include_usage:
                await response.write(chunk(None, {"usage": usage(stats)}))
        except PipelineError as exc:
            error = {"error": {"message": f"pipeline error: {public_text(str(exc))}", "type": "upstream_error", "param": None,
                               "code": "pipeline_error"}}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client went away mid-stream; generation %s stopped", stats.sid[:12])
            raise
        except Exception:  # a bug: the stream says so and ends; the node logs it
            log.exception("generation %s failed", stats.sid[:12])
            error = {"error": {"message": "internal error; the node logged it", "type": "server_error",
                               "param": None, "code": "internal_error"}}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _finish(stats: GenerationStats) -> str:
    return stats.finish_reason.value if stats.finish_reason else "length"
