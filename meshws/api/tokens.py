"""`POST /tokenize` and `POST /detokenize` (also under `/v1/`), shaped as vLLM and llama-server shape them.

`/tokenize` takes a `prompt` (vLLM) or `content` (llama-server) string, or chat
`messages`, and answers the token ids a completion (or chat) request with that input
would prefill: `{"tokens", "count", "max_model_len"}`, and with `with_pieces` (llama-
server) or `return_token_strs` (vLLM) each token's text too. `/detokenize` takes
`tokens` and answers the text as `prompt` (vLLM) and `content` (llama-server). Both are
guarded like `/v1/*` (API key, Host, Origin), bounded like a completion's prompt, at most
`MAX_TOKENIZING` at once, and admitted as generations are (each holds a generation slot while
it works, so a flood of them waits in the same queue and cannot crowd out the head).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..head.service import HeadService, Unavailable
from .answers import unavailable
from .errors import ApiError, json_response, read_json, shown
from .messages import message_chars, parse_messages
from .requests import CHARS_PER_TOKEN_CAP
from .tools import plain_messages

TOKENIZE_FIELDS = {"model", "prompt", "content", "messages", "with_pieces", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


MAX_TOKENIZING = 4  # /tokenize and /detokenize requests at work at once (they share the compute worker and threads)


class TokenRoutes:
    def __init__(self, head: HeadService) -> None:
        self.head = head
        self.working = 0  # requests of these routes at work now (past this bound: 429, nothing queued)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._bounded(self._tokenize, request)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._bounded(self._detokenize, request)

    async def _bounded(self, handler: Callable[[web.Request], Awaitable[web.Response]],
                       request: web.Request) -> web.Response:
        if self.working >= MAX_TOKENIZING:
            return ApiError(429, f"more than {MAX_TOKENIZING} tokenize requests at once; retry shortly",
                            code="rate_limit_exceeded", kind="rate_limit_error").response()
        self.working += 1
        try:
            slot = await self.head.admit_local()
        except Unavailable as exc:
            self.working -= 1
            return unavailable(exc).response()
        try:
            return await handler(request)
        finally:
            slot.release()
            self.working -= 1

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = self._body(await read_json(request), TOKENIZE_FIELDS)
            ids = await self._ids(body)
        except ApiError as exc:
            return exc.response()
        answer: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.head.context_length}
        if body.get("with_pieces") or body.get("return_token_strs"):
            if len(ids) > self.head.context_length:
                return ApiError(400, f"pieces for at most {self.head.context_length} tokens (the context length)",
                                param="with_pieces", code="invalid_value").response()
            pieces = await asyncio.to_thread(lambda: [self.head.decode([token]) for token in ids])
            answer["token_strs"] = pieces
            answer["pieces"] = [{"id": token, "piece": piece} for token, piece in zip(ids, pieces)]
        return json_response(answer)

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = self._body(await read_json(request), DETOKENIZE_FIELDS)
            tokens = body.get("tokens")
            vocab = self.head.vocab_size or 2**31
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                       for t in tokens):
                raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens",
                               code="invalid_value")
            if len(tokens) > self.head.context_length:
                raise ApiError(400, f"at most {self.head.context_length} tokens (the context length)",
                               param="tokens", code="invalid_value")
        except ApiError as exc:
            return exc.response()
        text = await asyncio.to_thread(self.head.decode, tokens)
        return json_response({"prompt": text, "content": text})

    def _body(self, body: dict[str, Any], fields: set[str]) -> dict[str, Any]:
        for name in body:
            if name not in fields:
                raise ApiError(400, f"unknown field {shown(name)}; this endpoint reads {', '.join(sorted(fields))}",
                               param=name[:64], code="unknown_parameter")
        model = body.get("model")
        if model is not None and model not in self.head.served_names:
            raise ApiError(404, f"the model '{str(model)[:200]}' does not exist", param="model",
                           code="model_not_found")
        for name in ("with_pieces", "return_token_strs"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise ApiError(400, f"'{name}' must be a boolean", param=name, code="invalid_type")
        return body

    async def _ids(self, body: dict[str, Any]) -> list[int]:
        """The ids a completion (`prompt`, `content`) or chat (`messages`) request would prefill."""
        limit = self.head.context_length * CHARS_PER_TOKEN_CAP
        if body.get("messages") is not None:
            messages = parse_messages(body)
            if sum(message_chars(message) for message in messages) > limit:
                raise ApiError(400, "the messages are longer than the context could hold", param="messages",
                               code="context_length_exceeded")
            try:
                text = await asyncio.to_thread(self.head.prompts.chat_prompt, plain_messages(messages, None))
            except Exception as exc:  # a model's Jinja template may raise on messages it does not expect
                raise ApiError(400, f"the model's chat template cannot render these messages: {str(exc)[:200]}",
                               param="messages", code="invalid_value") from None
        else:
            name = "prompt" if "prompt" in body else "content"
            text = body.get(name)
            if not isinstance(text, str):
                raise ApiError(400, "send 'prompt' (or 'content') as a string, or 'messages'", param=name,
                               code="invalid_type")
            if len(text) > limit:
                raise ApiError(400, "the prompt is longer than the context could hold", param=name,
                               code="context_length_exceeded")
        return await self.head.tokenize(text) if text else []

