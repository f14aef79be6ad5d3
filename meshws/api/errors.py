"""OpenAI-shaped errors, JSON answers, and the middleware that guards the API with its key."""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any, Callable

import orjson
from aiohttp import web

from ..mesh.log_limit import LogLimiter


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


ECHO_CHARS = 64  # a client's string quoted back in an error: no longer than this


def shown(value: Any, limit: int = ECHO_CHARS) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters (a client cannot make an
    answer larger than what it sent by repeating its own text)."""
    text = repr(value) if not isinstance(value, str) else repr(value[: limit + 1])
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


_ADDRESSES = [
    (re.compile(r"\b(?:wss?|https?)://[^\s,;)'\"]+"), "<node>"),  # URLs of nodes
    (re.compile(r"\b(head|middle|tail|full)@[^\s,;:)'\"]+(?::\d+)?"), r"\1"),  # node names carry host:port
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),  # IPv4, with a port
    (re.compile(r"\[[0-9a-fA-F:]+\](?::\d+)?"), "<address>"),  # [IPv6]:port
    (re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{1,4}(?:%\w+)?"), "<address>"),  # bare IPv6
    (re.compile(r"\b[A-Za-z0-9](?:[\w-]*\.)+[A-Za-z][\w-]*:\d{1,5}\b"), "<address>"),  # host.name:port
    (re.compile(r"\bhost [\w.-]+"), "host <address>"),  # aiohttp's "Cannot connect to host NAME"
]


def public_text(text: str) -> str:
    """An error text fit for API clients: the mesh's internal addresses taken out."""
    for pattern, replacement in _ADDRESSES:
        text = pattern.sub(replacement, text)
    return text


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def is_api_path(path: str) -> bool:
    """The OpenAI-style API and its neighbours: guarded by the API key, open to --cors-origins."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def key_matches(given: str, key: str) -> bool:
    """`given` (a header's or query's text: bytes that are not UTF-8 arrive as surrogates) is the API key, compared
    in constant time; any text at all is an answer, never an exception."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def error_middleware(api_key: Callable[[], str | None]) -> Any:
    """OpenAI-shaped 401/404/405 for the API routes; the API key check."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        guarded = is_api_path(path) or path == "/ws/chat"
        key = api_key()
        if guarded and key:
            given = request.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else request.query.get("api_key", "")
            if not key_matches(token, key):
                return ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                code="invalid_api_key").response()
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if not is_api_path(path) or exc.status < 400:
                raise
            message = f"no route {request.method} {path}" if exc.status in (404, 405) else exc.reason
            return ApiError(exc.status, message, code="not_found" if exc.status == 404 else None).response()
        except (ConnectionError, RuntimeError) as exc:
            if isinstance(exc, ConnectionError) or "closing transport" in str(exc):
                raise  # the client went away; nobody to answer
            return _internal(request, exc)
        except Exception as exc:  # a bug: the client gets a plain 500, never a traceback; one log line
            return _internal(request, exc)

    return middleware


_limited = LogLimiter(logging.getLogger("meshws.api"))


def _internal(request: web.Request, exc: Exception) -> web.Response:
    _limited.log(f"500 {type(exc).__name__}", logging.ERROR, "%s %s failed", request.method, request.path,
                 exc_info=exc)
    return ApiError(500, "internal error; the node logged it", code="internal_error", kind="server_error").response()
