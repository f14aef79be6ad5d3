"""Server-sent events to one client: whole events, small buffers, a write timeout, and pings while silent.

A stream that says nothing for a while — its request waiting in the admission queue,
a long prefill — gets a `: ping` comment line every `ping` seconds (clients skip
comments), so proxies and load balancers that cut idle connections leave it alone. A
write that waits more than `write_timeout` seconds for a client that stopped reading
drops the client (`SlowClient`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, Awaitable, TypeVar

import orjson
from aiohttp import web

log = logging.getLogger("meshws.api")

STREAM_BUFFER_BYTES = 8 * 1024  # what a streamed answer may queue for a client before a write waits (~40 tokens)
PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"  # OpenAI's last line of a stream
T = TypeVar("T")


def event_bytes(payload: Any, kind: str | None = None) -> bytes:
    """One server-sent event: an `event:` line when it is named (the Responses API's), then its JSON as `data:`."""
    return (f"event: {kind}\n".encode() if kind else b"") + b"data: " + orjson.dumps(payload) + b"\n\n"


class SlowClient(ConnectionError):
    """A write to a client did not finish within the write timeout: it stopped reading."""


def bound_write_buffers(request: web.Request) -> None:
    """Keep a streaming connection's buffers small, so a client that stops reading makes writes wait.

    Unbounded, the kernel's send buffer grows to megabytes on loopback and a stalled
    client goes unnoticed for thousands of tokens; a token stream needs only a few KiB.
    """
    transport = request.transport
    if transport is None:
        return
    try:
        transport.set_write_buffer_limits(high=STREAM_BUFFER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER_BYTES)
    except (AttributeError, NotImplementedError, OSError):
        pass  # a transport without these knobs: the write timeout still applies, later


async def until_drained(request: web.Request) -> None:
    """Wait while more than STREAM_BUFFER_BYTES wait to be sent to this client.

    aiohttp's writers wait for the socket only every 64 KiB written: hundreds of tokens
    to a client that reads nothing would otherwise go unnoticed.
    """
    transport = request.transport
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() > STREAM_BUFFER_BYTES:
        await asyncio.sleep(0.02)


class EventStream:
    def __init__(self, request: web.Request, ping: float, write_timeout: float) -> None:
        self.request = request
        self.ping = ping
        self.write_timeout = write_timeout
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._lock = asyncio.Lock()
        self._last_write = time.monotonic()
        self._pinger: asyncio.Task | None = None
        self._starting: asyncio.Future | None = None

    @property
    def open(self) -> bool:
        """The stream has started (or is starting): what follows goes as events, not as a status."""
        return self._starting is not None

    async def start(self) -> None:
        """Send the headers (200, an event stream); from now on errors travel as events."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._prepare())
            self._starting.add_done_callback(lambda task: task.cancelled() or task.exception())  # read, not lost
        await self._starting

    async def _prepare(self) -> None:
        await self.response.prepare(self.request)
        bound_write_buffers(self.request)
        self._last_write = time.monotonic()
        self._pinger = asyncio.create_task(self._keep_alive())

    async def waiting(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (the admission) in this task; if it takes longer than `ping`, the stream starts (in
        another task) and pings meanwhile."""
        starter = asyncio.get_running_loop().call_later(self.ping, self.start_soon)
        try:
            return await awaitable
        finally:
            starter.cancel()

    def start_soon(self) -> None:
        if self._starting is None:  # (set now: whoever looks next sees the stream started)
            self._starting = asyncio.ensure_future(self._prepare())
            self._starting.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def send(self, data: bytes) -> None:
        """Write one event (starting the stream if need be); SlowClient if the client does not take it in time."""
        await self.start()
        async with self._lock:
            try:  # asyncio.timeout, not wait_for: wait_for (3.11) loses a cancellation that meets a finished write
                async with asyncio.timeout(self.write_timeout):
                    await self.response.write(data)
                    await until_drained(self.request)
            except TimeoutError:
                if self.request.transport is not None:
                    self.request.transport.abort()  # nothing more will reach this client
                raise SlowClient(f"the client read nothing for {self.write_timeout:g} s") from None
            self._last_write = time.monotonic()

    async def event(self, payload: Any, kind: str | None = None) -> None:
        """One event of `payload` (`event_bytes`); SlowClient as `send`."""
        await self.send(event_bytes(payload, kind))

    async def done(self) -> None:
        """OpenAI's `data: [DONE]`: no more events follow."""
        await self.send(DONE)

    async def finish(self) -> web.StreamResponse:
        """The end of the stream: no more pings, EOF."""
        self.stop_pings()
        await self.response.write_eof()
        return self.response

    def stop_pings(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self._last_write + self.ping - time.monotonic()))
            if time.monotonic() - self._last_write < self.ping or self._lock.locked():
                continue
            try:
                await self.send(PING)
            except (SlowClient, ConnectionError, RuntimeError):
                return  # the stream's own next write meets the same fate and says so
