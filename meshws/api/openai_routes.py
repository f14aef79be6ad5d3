"""The OpenAI-compatible HTTP API of a head (or full) node.

POST /v1/chat/completions, POST /v1/completions, GET /v1/models; streaming is
SSE. This file only translates: `requests.check_request` validates a request, the
head admits it (it may wait in the admission queue), `requests.complete_spec` then
templates and tokenizes it into a `CompletionSpec`, the head streams its text, and the
answer and every error are shaped the way the official `openai` client expects. A write
to a client that has stopped reading gives up after `write_timeout` seconds: the
connection is dropped and the generation's session released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..head.generation import GenerationStats, PipelineError
from ..head.service import Admission, HeadService, Unavailable
from .answers import finish_reason, pipeline_failure, run_spec, stream_error, unavailable, usage
from .completion_batch import serve_batch
from .errors import ApiError, json_response, read_json
from .logprobs import chat_logprobs, completion_logprobs, joined, prompt_logprobs
from .requests import CompletionSpec, check_request, complete_spec
from .response_routes import ResponsesApi
from .sse import EventStream, SlowClient
from .choices import Choice, run_choices
from .chunks import Chunks
from .tools import CallSplitter, calls_in
from .tokens import TokenRoutes

log = logging.getLogger("meshws.api")


@dataclass
class _Told:
    """What a streamed answer has told so far: its tokens' log-probabilities, and its text's length before them (a
    completion's offsets count from the answer's start, its echoed prompt included)."""

    logprobs: int = 0
    offset: int = 0


class OpenAIApi:
    def __init__(self, head: HeadService, write_timeout: float = 30.0, sse_ping: float = 15.0) -> None:
        self.head = head
        self.write_timeout = write_timeout  # seconds one write to a client may take
        self.sse_ping = sse_ping  # seconds a stream may stay silent before a ": ping" comment
        self.created = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name:.+}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", ResponsesApi(self.head, self.write_timeout, self.sse_ping).create)
        tokens = TokenRoutes(self.head)
        for path in ("/tokenize", "/v1/tokenize"):
            app.router.add_post(path, tokens.tokenize)
        for path in ("/detokenize", "/v1/detokenize"):
            app.router.add_post(path, tokens.detokenize)

    def _describe(self, name: str) -> dict[str, Any]:
        """A model entry as OpenAI lists it, with the context length as vLLM (`max_model_len`) and others name it."""
        context = self.head.context_length
        return {"id": name, "object": "model", "created": self.created, "owned_by": "meshws",
                "root": self.head.model_id, "parent": None, "max_model_len": context, "context_length": context}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._describe(name) for name in self.head.served_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.head.served_names:
            return ApiError(404, f"the model '{name[:200]}' does not exist", param="model",
                            code="model_not_found").response()
        return json_response(self._describe(name))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        stats = GenerationStats(sid=uuid.uuid4().hex)  # its clock starts at the request's arrival
        stream: EventStream | None = None
        try:  # admission before any work on the prompt; a client that hangs up meanwhile cancels it
            draft = check_request(await read_json(request), chat, self.head)
            if draft.body.get("stream"):  # a long wait in the queue: the stream starts and pings
                stream = EventStream(request, self.sse_ping, self.write_timeout)
                admission = await stream.waiting(self.head.admit())
            else:
                admission = await self.head.admit()
        except ApiError as exc:
            return exc.response()
        except Unavailable as exc:
            if stream is not None and stream.open:
                return await stream_error(stream, unavailable(exc).body())
            return unavailable(exc).response()
        if draft.batch:  # several prompts: each a request of its own
            try:
                return await serve_batch(self.head, draft, admission, stream, self._choice)
            finally:
                admission.release()
                if stream is not None:
                    stream.stop_pings()
        n = draft.body.get("n") or 1
        extra = self.head.queue.take_now(n - 1) if n > 1 else []  # each choice is a generation: a slot each
        if extra is None:
            admission.release()
            error = unavailable(Unavailable(f"{n} choices need {n} free generation slots; retry shortly",
                                            "queue_full", 1))
            return await stream_error(stream, error.body()) if stream is not None and stream.open \
                else error.response()
        kind = "chat.completion" if chat else "text_completion"
        answer_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if draft.sampling.logprobs is not None:
            stats.logprobs = []
        try:
            spec = await complete_spec(draft, self.head)
            spec.owner = f"{request.remote}\n{draft.body.get('user')}"  # a warm session serves its owner only
            if stream is not None:
                return await self._stream(stream, spec, admission, chat, answer_id, stats)
            return await self._complete(spec, admission, chat, kind, answer_id, stats)
        except ApiError as exc:
            if stream is not None and stream.open:
                return await stream_error(stream, exc.body())
            return exc.response()
        finally:
            admission.release()  # the generation released it already, unless it never started
            for slot in extra:
                slot.release()
            if stream is not None:
                stream.stop_pings()

    def _logprobs(self, stats: GenerationStats, chat: bool, start: int, end: int,
                  offset: int = 0) -> dict[str, Any] | None:
        """The log-probabilities of tokens `start:end` as the endpoint shapes them; None when not asked for."""
        if stats.logprobs is None:
            return None
        entries = stats.logprobs[start:end]
        return chat_logprobs(entries, self.head.decode) if chat else \
            completion_logprobs(entries, self.head.decode, offset)

    def _echoed(self, spec: CompletionSpec, stats: GenerationStats) -> tuple[str, dict[str, Any] | None]:
        """`echo`: the prompt's text, and its tokens' log-probabilities if asked for (the tail's, from the prefill)."""
        text = spec.prompt or self.head.decode(spec.prompt_ids)
        if stats.logprobs is None:
            return text, None
        return text, prompt_logprobs(spec.prompt_ids, stats.prompt_logprobs or (), self.head.decode)

    async def _complete(self, spec: CompletionSpec, admission: Admission, chat: bool, kind: str,
                        answer_id: str, stats: GenerationStats) -> web.Response:
        try:
            if spec.n > 1:
                choices = await run_choices(self.head, spec, admission, stats)
            else:
                choices = [Choice(stats)]
                async with aclosing(run_spec(self.head, spec, stats, admission, choices[0].token_ids)) as deltas:
                    async for delta in deltas:
                        choices[0].parts.append(delta)
        except PipelineError as exc:
            if stats.completion_tokens:
                log.warning("generation %s failed after %d tokens: %s", stats.sid[:12], stats.completion_tokens, exc)
            return pipeline_failure(exc).response()
        counts = usage(stats, choices)
        answer = {
            "id": answer_id,
            "object": kind,
            "created": int(time.time()),
            "model": spec.model,
            "choices": [self._choice(spec, chat, choice, index, stats) for index, choice in enumerate(choices)],
            "usage": counts,
            "system_fingerprint": None,
        }
        if spec.return_token_ids:
            answer["prompt_token_ids"] = spec.prompt_ids
        return json_response(answer)

    def _choice(self, spec: CompletionSpec, chat: bool, done: Choice, index: int,
                first: GenerationStats) -> dict[str, Any]:
        """One choice of a whole answer: its text (or tool calls), why it ended, its log-probabilities."""
        stats, text = done.stats, done.text
        echoed = self._echoed(spec, first) if spec.echo else ("", None)  # (the prompt was prefilled once)
        logprobs = self._logprobs(stats, chat, 0, len(stats.logprobs or ()), len(echoed[0]))
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(stats),
                                  "logprobs": joined(echoed[1], logprobs) if echoed[1] and logprobs else logprobs}
        if chat:
            content, calls = calls_in(text, spec.tools) if spec.tools is not None else (text, [])
            choice["message"] = {"role": "assistant", "content": (content or None) if calls else text}
            if calls:
                choice["message"]["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
        else:
            choice["text"] = echoed[0] + text
        if spec.return_token_ids:
            choice["token_ids"] = done.token_ids
        return choice

    def _logprobs_since(self, stats: GenerationStats, chat: bool, told: _Told, text: str | None,
                        finish: str | None) -> dict[str, Any] | None:
        """A streamed answer's log-probabilities of the tokens since its last chunk (at its end: all told, or
        none), then `text` counted in its offsets."""
        logprobs = None
        if stats.logprobs is not None and (len(stats.logprobs) > told.logprobs or finish):
            logprobs = self._logprobs(stats, chat, told.logprobs, len(stats.logprobs), told.offset)
            told.logprobs = len(stats.logprobs)
        told.offset += len(text or "")
        return logprobs

    async def _stream_choices(self, stream: EventStream, spec: CompletionSpec, admission: Admission,
                              chunks: Chunks, stats: GenerationStats) -> web.StreamResponse:
        """`n` > 1, streamed: each choice's text as it comes (chunks say their `index`), then each one's end."""
        try:
            await stream.start()
            for index in range(spec.n if chunks.chat else 0):
                await stream.event(chunks.one(index, "", role=True))
            choices = await run_choices(self.head, spec, admission, stats,
                                        lambda index, delta: stream.event(chunks.one(index, delta)))
            for index, choice in enumerate(choices):
                await stream.event(chunks.one(index, None, finish_reason(choice.stats)))
            if spec.include_usage:
                await stream.event(chunks.frame([], usage=usage(stats, choices)))
        except PipelineError as exc:
            await stream.event(pipeline_failure(exc).body())
        except SlowClient:
            return stream.response  # aborted already
        await stream.done()
        return await stream.finish()

    async def _stream(self, stream: EventStream, spec: CompletionSpec, admission: Admission, chat: bool,
                      answer_id: str, stats: GenerationStats) -> web.StreamResponse:
        chunks = Chunks(answer_id, chat, spec.model)
        if spec.n > 1:
            return await self._stream_choices(stream, spec, admission, chunks, stats)
        told = _Told()

        def piece(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            return chunks.one(0, text, finish, role, self._logprobs_since(stats, chat, told, text, finish))

        async def write(payload: dict[str, Any] | None) -> None:
            """One chunk, or (None) the stream's [DONE]."""
            try:
                await (stream.done() if payload is None else stream.event(payload))
            except SlowClient:  # said now: the release that follows may end in the handler's cancellation
                log.warning("generation %s: the client read nothing for %g s; dropped it and released its session",
                            stats.sid[:12], self.write_timeout)
                raise

        async def echo_prompt() -> bool:
            """A completion's echoed prompt, as its first chunk; False: no echo left to send."""
            text, logprobs = self._echoed(spec, stats)
            told.offset = len(text)  # the answer's offsets start after it
            await write(chunks.one(0, text, logprobs=logprobs))
            return False

        try:
            await stream.start()  # headers now: a long prefill is pinged through
            if chat:
                await write(piece("", role=True))
            echo = spec.echo  # the prompt goes first, once its prefill has run (and told its log-probabilities)
            tools = spec.tools if spec.tools is not None and spec.tools.choice != "none" else None
            splitter, parts = CallSplitter(in_call=tools is not None and tools.forced), []
            async with aclosing(run_spec(self.head, spec, stats, admission)) as deltas:
                async for delta in deltas:
                    if echo:
                        echo = await echo_prompt()
                    parts.append(delta)
                    content = splitter.feed(delta) if tools is not None else delta
                    if content:
                        await write(piece(content))
            if echo:
                await echo_prompt()
            finish = finish_reason(stats)
            if tools is not None:  # the calls, whole, once the answer is complete
                calls = calls_in("".join(parts), tools)[1]
                held = splitter.rest(bool(calls))  # held back for a call that did not come: content after all
                if held:
                    await write(piece(held))
                if calls:
                    finish = "tool_calls"
                    listed = [{"index": i, **call} for i, call in enumerate(calls)]
                    await write(chunks.frame([{"index": 0, "delta": {"tool_calls": listed}, "finish_reason": None,
                                               "logprobs": None}]))
            await write(piece(None, finish))
            if spec.include_usage:
                await write(chunks.frame([], usage=usage(stats)))
        except PipelineError as exc:
            await write(pipeline_failure(exc).body())
        except SlowClient:
            return stream.response  # aborted already; said in the log
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client went away mid-stream; generation %s stopped", stats.sid[:12])
            raise
        except Exception:  # a bug: the stream says so and ends; the node logs it
            log.exception("generation %s failed", stats.sid[:12])
            await write({"error": {"message": "internal error; the node logged it", "type": "server_error",
                                   "param": None, "code": "internal_error"}})
        await write(None)
        return await stream.finish()
