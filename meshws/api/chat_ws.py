"""`GET /ws/chat`: the websocket the browser page and scripts chat over.

Client -> server (JSON text frames):
  {"type": "chat", "messages": [...], "max_tokens"?, "temperature"?, "top_p"?, "top_k"?,
   "seed"?, "stop"?, "id"?}                 start a chat turn; one runs at a time per socket,
                                            and a new one stops the running one first
  {"type": "stop"}                          stop the running turn; its session is released
Server -> client:
  {"type": "start", "id", "model", "prompt_tokens"}
  {"type": "delta", "id", "text"}           text as it is generated
  {"type": "done", "id", "finish_reason": "stop"|"length"|"stopped", "text",
   "usage": {...}, "timing": {"ttft_ms", "tokens_per_second", "total_ms"}, "route": [...]}
  {"type": "error", "id"?, "message"}       a bad message, or the mesh failed
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import suppress
from typing import Any, Callable

import orjson
from aiohttp import WSMsgType, web

from ..head.generation import FinishReason, GenerationStats, PipelineError
from ..head.service import HeadService, Unavailable
from .errors import ApiError, public_text
from .openai_routes import run_spec, usage
from .requests import build_spec

log = logging.getLogger("meshws.chat")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class ChatSocket:
    def __init__(self, head: HeadService, detail_allowed: Callable[[web.Request], bool] = lambda request: False) -> None:
        self.head = head
        self.detail_allowed = detail_allowed  # may this client see node names and addresses?
        self.sockets: set[web.WebSocketResponse] = set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/ws/chat", self.handle)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        self.sockets.add(ws)
        detailed = self.detail_allowed(request)
        running: asyncio.Task | None = None
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    if message.type == WSMsgType.BINARY:
                        await _send(ws, {"type": "error", "message": "send JSON text messages"})
                    continue
                try:
                    data = orjson.loads(message.data)
                except orjson.JSONDecodeError:
                    await _send(ws, {"type": "error", "message": "the message is not valid JSON"})
                    continue
                kind = data.get("type") if isinstance(data, dict) else None
                if kind == "stop":
                    if running is not None and not running.done():
                        running.cancel()
                    continue
                if kind != "chat":
                    await _send(ws, {"type": "error", "message": f"unknown message type {kind!r}; use chat or stop"})
                    continue
                if running is not None and not running.done():  # a new turn replaces the running one
                    running.cancel()
                    with suppress(asyncio.CancelledError):
                        await running
                running = asyncio.create_task(self._turn(ws, data, detailed))
        finally:
            self.sockets.discard(ws)
            if running is not None and not running.done():
                running.cancel()
                with suppress(asyncio.CancelledError):
                    await running
        return ws

    async def shutdown(self) -> None:
        """The node is stopping: close every chat socket (their turns stop and release)."""
        for ws in list(self.sockets):
            await ws.close(code=1001, message=b"node shutting down")

    async def _turn(self, ws: web.WebSocketResponse, data: dict[str, Any], detailed: bool) -> None:
        turn_id = data.get("id") if isinstance(data.get("id"), (str, int)) else uuid.uuid4().hex[:12]
        body = {key: value for key, value in data.items() if key not in ("type", "id", "stream")}
        body.setdefault("model", self.head.model_id)
        body.setdefault("temperature", 0.7)
        try:
            spec = await build_spec(body, True, self.head)
            route = self.head.admit()
        except Unavailable as exc:
            await _send(ws, {"type": "error", "id": turn_id, "message": public_text(str(exc)), "param": None})
            return
        except ApiError as exc:
            await _send(ws, {"type": "error", "id": turn_id, "message": exc.message, "param": exc.param})
            return
        stats = GenerationStats(sid=uuid.uuid4().hex)
        parts: list[str] = []
        try:
            await _send(ws, {"type": "start", "id": turn_id, "model": self.head.model_id,
                             "prompt_tokens": len(spec.prompt_ids)})
            async for delta in run_spec(self.head, spec, stats, route):
                parts.append(delta)
                await _send(ws, {"type": "delta", "id": turn_id, "text": delta})
            finish = stats.finish_reason or FinishReason.LENGTH
        except asyncio.CancelledError:
            finish = FinishReason.STOPPED
        except Exception as exc:  # a pipeline failure, or a bug: the client hears of it either way
            if not isinstance(exc, PipelineError):
                log.exception("turn %s failed", turn_id)
                exc = PipelineError("internal error; the node logged it")
            await _send(ws, {"type": "error", "id": turn_id, "message": f"pipeline error: {public_text(str(exc))}",
                             "text": "".join(parts)})
            return
        finally:
            route.release()
        stats.finished_at = stats.finished_at or time.perf_counter()
        ttft = stats.time_to_first_token
        await _send(ws, {
            "type": "done",
            "id": turn_id,
            "finish_reason": finish.value,
            "text": "".join(parts),
            "usage": usage(stats),
            "timing": {
                "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
                "tokens_per_second": round(stats.decode_tokens_per_second or 0.0, 2),
                "total_ms": round((stats.finished_at - stats.started) * 1000, 1),
            },
            "route": stats.route if detailed else public_route(stats.route),
        })


def public_route(route: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The route for people who may not see the mesh's insides: roles and layers, no names or URLs."""
    return [{"node": str(hop.get("node", "")).split("@")[0], "layers": hop.get("layers")} for hop in route]


async def _send(ws: web.WebSocketResponse, message: dict[str, Any]) -> None:
    if not ws.closed:
        with suppress(ConnectionError, RuntimeError):
            await ws.send_str(orjson.dumps(message).decode())
