"""OpenAI-shaped errors, JSON answers, and the middleware that guards the API with its key."""

from __future__ import annotations

import hmac
from typing import Any, Callable

import orjson
from aiohttp import web


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
