"""`GET /ws/chat`: the websocket the browser page and scripts chat over.

Client -> server (JSON text frames):
  {"type": "chat", "messages": [...], "max_tokens"?, "temperature"?, "top_p"?, "top_k"?,
   "seed"?, "stop"?, "id"?, "trace"?,
   "logprobs"?, "top_logprobs"?}           start a chat turn; one runs at a time per socket,
                                            and a new one stops the running one first;
                                            `trace: true` adds every lap to `hops` in `done`
  {"type": "stop"}                          stop the running turn
  {"type": "reset"}                         a new conversation: stop the running turn, release the session
  {"type": "render", "id"?, "text"}         Markdown (model output) as sanitized HTML, for the page
Server -> client:
  {"type": "start", "id", "model", "prompt_tokens"}
  {"type": "delta", "id", "text"}           text as it is generated
  {"type": "done", "id", "finish_reason": "stop"|"length"|"stopped", "text",
   "usage": {...}, "cached_tokens", "timing": {"ttft_ms", "tokens_per_second", "total_ms"}, "route": [...],
   "hops": {"laps", "head_ms", "hops": [{"node", "ms"}], "network_ms", "per_lap_ms", "trace"?}}
                                            where the answer's time went: the head's layers, each
                                            shard (as it reports), the links (the rest)
  {"type": "reset", "id"?}                  the conversation's session is released
  {"type": "rendered", "id"?, "html"}       the answer to `render` (api/markdown.py: nothing in it runs)
  {"type": "error", "id"?, "message"}       a bad message, or the mesh failed
An `id` is echoed in every answer to its message, so it is bounded: a string of at most 128 characters or an
integer (else an error, and the message is not run).

The socket is its conversation's channel: every turn goes on in one session, whose
caches (on every shard of its route) keep the prompt and answer between turns, so a
turn prefills only the tokens after the longest prefix it shares with them
(`cached_tokens` says how many were reused). `reset` or the socket's close releases the
session everywhere. A turn that fails, or is stopped while a step is on its way, ends
the session too; the next turn opens a new one.

A turn waits in the head's admission queue before its prompt is tokenized. A client
that stops reading is dropped once a send has waited `write_timeout` seconds; its
running turn stops and its session is released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing, suppress
from typing import Any, Callable

import orjson
from aiohttp import WSMsgType, web

from ..head.conversation import Conversation
from ..head.generation import FinishReason, GenerationStats, PipelineError
from ..head.service import HeadService, Unavailable
from .errors import ApiError, public_text, shown
from .logprobs import chat_logprobs
from .markdown import MAX_RENDER_CHARS, Renderer, RenderBusy
from .answers import run_spec, usage
from .sse import bound_write_buffers, until_drained
from .requests import check_request, complete_spec

log = logging.getLogger("meshws.chat")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class ChatSocket:
    def __init__(self, head: HeadService, detail_allowed: Callable[[web.Request], bool] = lambda request: False,
                 write_timeout: float = 30.0) -> None:
        self.head = head
        self.write_timeout = write_timeout  # seconds one send to a client may take
        self.detail_allowed = detail_allowed  # may this client see node names and addresses?
        self.sockets: set[web.WebSocketResponse] = set()
        self.renderer = Renderer()  # one thread of its own for every socket's renders

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/ws/chat", self.handle)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        bound_write_buffers(request)
        send = _Sender(ws, request, self.write_timeout)
        self.sockets.add(ws)
        detailed = self.detail_allowed(request)
        running: asyncio.Task | None = None
        conversation = Conversation()
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    if message.type == WSMsgType.BINARY:
                        await send({"type": "error", "message": "send JSON text messages"})
                    continue
                try:
                    data = orjson.loads(message.data)
                except orjson.JSONDecodeError:
                    await send({"type": "error", "message": "the message is not valid JSON"})
                    continue
                kind = data.get("type") if isinstance(data, dict) else None
                if kind == "stop":
                    if running is not None and not running.done():
                        running.cancel()
                    continue
                if kind in ("chat", "reset", "render") and not valid_id(data):  # (answers echo it: bounded)
                    await send({"type": "error", "message": ID_RULE, "param": "id", "code": "invalid_value"})
                    continue
                if kind == "render":  # one at a time per socket: the next message waits for it
                    await send(await rendered(self.renderer, data))
                    continue
                if kind not in ("chat", "reset"):
                    await send({"type": "error", "message": f"unknown message type {shown(kind)}; use chat, stop, "
                                                            "reset or render"})
                    continue
                if running is not None and not running.done():  # a new turn (or a reset) replaces the running one
                    running.cancel()
                    with suppress(asyncio.CancelledError):
                        await running
                if kind == "reset":
                    await self.head.end_conversation(conversation)
                    conversation = Conversation()
                    reply = {"type": "reset", "id": data["id"]} if isinstance(data.get("id"), (str, int)) \
                        else {"type": "reset"}
                    await send(reply)
                    continue
                running = asyncio.create_task(self._turn(send, data, detailed, conversation))
        except _SlowClient:
            pass  # dropped: the socket is closed
        finally:
            self.sockets.discard(ws)
            if running is not None and not running.done():
                running.cancel()
                with suppress(asyncio.CancelledError):
                    await running
            await self.head.end_conversation(conversation)
        return ws

    async def shutdown(self) -> None:
        """The node is stopping: close every chat socket (their turns stop and release)."""
        for ws in list(self.sockets):
            with suppress(asyncio.TimeoutError, ConnectionError, RuntimeError):
                await asyncio.wait_for(ws.close(code=1001, message=b"node shutting down"), self.write_timeout)
        self.renderer.close()

    async def _turn(self, send: "_Sender", data: dict[str, Any], detailed: bool,
                    conversation: Conversation) -> None:
        try:
            await self._run_turn(send, data, detailed, conversation)
        except _SlowClient:
            pass  # the socket is dropped; the turn's session is released already

    async def _run_turn(self, send: "_Sender", data: dict[str, Any], detailed: bool,
                        conversation: Conversation) -> None:
        turn_id = data.get("id") if isinstance(data.get("id"), (str, int)) else uuid.uuid4().hex[:12]
        body = {key: value for key, value in data.items() if key not in ("type", "id", "stream", "trace")}
        body.setdefault("model", self.head.model_id)
        body.setdefault("temperature", 0.7)
        stats = GenerationStats(sid=uuid.uuid4().hex)  # its clock starts now: time in the queue counts
        try:  # admission before any work on the prompt
            draft = check_request(body, True, self.head)
            if draft.tools is not None or (body.get("n") or 1) > 1:
                param = "tools" if draft.tools is not None else "n"
                raise ApiError(400, f"'{param}' is for /v1/chat/completions; a /ws/chat turn is one answer in text",
                               param=param, code="unsupported_parameter")
            admission = await self.head.admit()
        except Unavailable as exc:
            await send({"type": "error", "id": turn_id, "message": public_text(str(exc)), "param": None,
                        "code": exc.code, "retry_after": exc.retry_after})
            return
        except ApiError as exc:
            await send({"type": "error", "id": turn_id, "message": exc.message, "param": exc.param})
            return
        except asyncio.CancelledError:
            return  # stopped (or replaced, or the socket closed) while waiting in line
        if data.get("trace") is True:  # every lap: what it carried, each hop's time and cache length
            stats.times.trace = []
        if draft.sampling.logprobs is not None:
            stats.logprobs = []
        parts: list[str] = []
        try:
            spec = await complete_spec(draft, self.head)
            await send({"type": "start", "id": turn_id, "model": self.head.model_id,
                        "prompt_tokens": len(spec.prompt_ids)})
            async with aclosing(run_spec(self.head, spec, stats, admission, conversation=conversation)) as deltas:
                async for delta in deltas:
                    parts.append(delta)
                    await send({"type": "delta", "id": turn_id, "text": delta})
            finish = stats.finish_reason or FinishReason.LENGTH
        except asyncio.CancelledError:
            finish = FinishReason.STOPPED
        except ApiError as exc:
            await send({"type": "error", "id": turn_id, "message": exc.message, "param": exc.param})
            return
        except _SlowClient:
            raise
        except Exception as exc:  # a pipeline failure, or a bug: the client hears of it either way
            if not isinstance(exc, PipelineError):
                log.exception("turn %s failed", turn_id)
                exc = PipelineError("internal error; the node logged it")
            await send({"type": "error", "id": turn_id, "message": f"pipeline error: {public_text(str(exc))}",
                        "text": "".join(parts)})
            return
        finally:
            admission.release()
        stats.finished_at = stats.finished_at or time.perf_counter()
        ttft = stats.time_to_first_token
        await send({
            "type": "done",
            "id": turn_id,
            "finish_reason": finish.value,
            "text": "".join(parts),
            "usage": usage(stats),
            "cached_tokens": stats.cached_tokens,
            "timing": {
                "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
                "tokens_per_second": round(stats.decode_tokens_per_second or 0.0, 2),
                "total_ms": round((stats.finished_at - stats.started) * 1000, 1),
            },
            "route": stats.route if detailed else public_route(stats.route),
            "hops": stats.times.view(str if detailed else public_name),
            **({"logprobs": chat_logprobs(stats.logprobs, self.head.decode)} if stats.logprobs is not None else {}),
        })


MAX_ID_CHARS = 128
ID_RULE = f"'id' must be a string of at most {MAX_ID_CHARS} characters or an integer"


def valid_id(data: dict[str, Any]) -> bool:
    """A message's `id` is absent, or one that may be echoed in every answer: short text or a 64-bit integer."""
    turn_id = data.get("id")
    if turn_id is None:
        return True
    if isinstance(turn_id, str):
        return len(turn_id) <= MAX_ID_CHARS
    return isinstance(turn_id, int) and not isinstance(turn_id, bool) and -2**63 <= turn_id < 2**64


async def rendered(renderer: Renderer, data: dict[str, Any]) -> dict[str, Any]:
    """The answer to a `render` message (on the renderer's thread: a long answer takes milliseconds)."""
    text = data.get("text")
    reply: dict[str, Any] = {"id": data["id"]} if isinstance(data.get("id"), (str, int)) else {}
    if not isinstance(text, str):
        return {"type": "error", **reply, "message": "render needs 'text', a string"}
    if len(text) > MAX_RENDER_CHARS:
        return {"type": "error", **reply, "message": f"render takes at most {MAX_RENDER_CHARS} characters"}
    try:
        return {"type": "rendered", **reply, "html": await renderer.render(text)}
    except RenderBusy as exc:
        return {"type": "error", **reply, "message": str(exc), "code": "busy"}


def public_route(route: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The route for people who may not see the mesh's insides: roles and layers, no names or URLs."""
    return [{"node": public_name(hop.get("node", "")), "layers": hop.get("layers")} for hop in route]


def public_name(node: Any) -> str:
    """A node as the public sees it: its role, not its name or address."""
    return str(node).split("@")[0]


class _SlowClient(Exception):
    """A send did not finish within the write timeout: the client stopped reading and is dropped."""


class _Sender:
    """Sends a socket's messages; one that waits longer than `timeout` drops the connection."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request, timeout: float) -> None:
        self.ws = ws
        self.request = request
        self.timeout = timeout

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        try:
            with suppress(ConnectionError, RuntimeError):
                async with asyncio.timeout(self.timeout):  # not wait_for, which may lose a cancellation
                    await self._send(orjson.dumps(message).decode())
        except TimeoutError:
            log.warning("a /ws/chat client read nothing for %g s; dropped it", self.timeout)
            if self.request.transport is not None:
                self.request.transport.abort()
            raise _SlowClient() from None

    async def _send(self, text: str) -> None:
        await self.ws.send_str(text)
        await until_drained(self.request)
