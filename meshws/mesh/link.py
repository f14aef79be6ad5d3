"""A link: one persistent websocket from this node to a next hop, shared by all sessions.

The link dials `/ws/shard`, trades `hello` frames (protocol version, model id,
layer range and the chain behind the peer), keeps itself alive with websocket
heartbeats and re-dials with backoff when it drops. Replies arrive as control
frames and are handed to whoever subscribed to their `sid`; when the link
drops, every subscriber is told so with an `error` frame marked `lost`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl as ssl_module
import time
from typing import Any, Callable

import aiohttp

from .auth import signed_headers
from .log_limit import LogLimiter
from .wire import CacheMiss, ControlMessage, Error, FrameError, Hello, SessionReply, Token, decode_control, encode_control

log = logging.getLogger("meshws.link")

Subscriber = Callable[[SessionReply], None]


class LinkDown(Exception):
    """The link is not connected; the message says why."""


class Link:
    def __init__(
        self,
        url: str,
        local_hello: Callable[[], Hello],
        *,
        max_frame_bytes: int,
        heartbeat: float = 5.0,
        on_change: Callable[["Link"], None] | None = None,
        secret: str | None = None,
        ssl: ssl_module.SSLContext | bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.state = "new"  # new | connecting | up | down | refused | closed
        self.peer_hello: Hello | None = None
        self.last_error: str | None = None
        self.connects = 0
        self.last_used = time.monotonic()  # when a session last subscribed or left (idle links are closed)
        self._local_hello = local_hello
        self._secret = secret
        self._ssl = ssl  # verifies wss:// peers (the system's CAs, or --tls-ca)
        self._max_frame_bytes = max_frame_bytes
        self._heartbeat = heartbeat
        self._on_change = on_change
        self._subscribers: dict[str, Subscriber] = {}
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._client: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._up = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._log_limit = LogLimiter(log)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._dial_forever(), name=f"link {self.url}")

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @property
    def is_up(self) -> bool:
        return self.state == "up" and self._ws is not None and not self._ws.closed

    async def close(self) -> None:
        self.state = "closed"
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._ws is not None:
            await self._ws.close()
        if self._client is not None:
            await self._client.close()
        self._fail_subscribers("link closed")

    def status(self) -> str:
        """Its state, with the last error when there is one: 'down (ConnectionRefused...)'."""
        return self.state + (f" ({self.last_error})" if self.last_error else "")

    def describe(self) -> dict[str, Any]:
        peer = self.peer_hello
        return {
            "url": self.url,
            "state": self.state,
            "peer": peer.node if peer else None,
            "layers": list(peer.layers) if peer else None,
            "sessions": len(self._subscribers),
            "connects": self.connects,
            "error": self.last_error,
        }

    # -- sessions -----------------------------------------------------------

    @property
    def sessions(self) -> int:
        return len(self._subscribers)

    def subscribe(self, sid: str, callback: Subscriber) -> None:
        self._subscribers[sid] = callback
        self.last_used = time.monotonic()

    def unsubscribe(self, sid: str) -> None:
        self._subscribers.pop(sid, None)
        self.last_used = time.monotonic()

    async def send_control(self, message: ControlMessage) -> None:
        await self._send(encode_control(message))

    async def send_forward(self, data: bytes) -> None:
        await self._send(data)

    async def _send(self, data: str | bytes) -> None:
        ws = self._ws
        if ws is None or ws.closed or self.state != "up":
            raise LinkDown(f"link to {self.url} is {self.status()}")
        try:
            async with self._send_lock:
                if isinstance(data, bytes):
                    await ws.send_bytes(data)
                else:
                    await ws.send_str(data)
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            raise LinkDown(f"link to {self.url} failed while sending: {exc}") from exc

    # -- the dial loop ------------------------------------------------------

    async def _dial_forever(self) -> None:
        backoff = 0.1
        self._client = aiohttp.ClientSession()
        while self.state != "closed":
            self.state = "connecting"
            try:
                await self._connect_once()
                backoff = 0.1
                await self._read_until_closed()
            except asyncio.CancelledError:
                raise
            except aiohttp.ClientConnectorCertificateError as exc:
                self.state = "refused"
                self.last_error = f"the peer's certificate does not verify: {exc.certificate_error}"
                log.error("link to %s refused: %s (is --tls-ca the mesh's CA?)", self.url, self.last_error)
            except Exception as exc:  # every way a dial can fail ends in a retry
                self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            finally:
                was_up = self._up.is_set()
                self._up.clear()
                self._ws = None
                if self.state != "closed":
                    self.state = "refused" if self.state == "refused" else "down"
                if was_up:
                    log.warning("link to %s dropped (%s); re-dialing", self.url, self.last_error or "closed")
                    self._fail_subscribers(f"link to {self.url} lost ({self.last_error or 'closed'})")
                    self._changed()
            delay = backoff * (1 + random.random() * 0.2)
            await asyncio.sleep(5.0 if self.state == "refused" else delay)
            backoff = min(backoff * 2, 3.0)

    async def _connect_once(self) -> None:
        assert self._client is not None
        headers = await signed_headers(self._client, self.url, self._secret, "GET", "/ws/shard", ssl=self._ssl)
        ws = await self._client.ws_connect(
            f"{self.url}/ws/shard",
            heartbeat=self._heartbeat,
            max_msg_size=self._max_frame_bytes + 65536,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
            headers=headers,
            ssl=self._ssl,
        )
        try:
            await ws.send_str(encode_control(self._local_hello()))
            message = await ws.receive(timeout=15.0)
            if message.type != aiohttp.WSMsgType.TEXT:
                reason = ws.close_code, getattr(message, "extra", None) or message.data
                raise LinkDown(f"peer closed the handshake: {reason}")
            try:
                reply = decode_control(message.data)
            except FrameError as exc:
                self.state = "refused"
                raise LinkDown(f"peer's hello is not acceptable: {exc}") from None
            if isinstance(reply, Error):
                raise LinkDown(f"peer refused the link: {reply.message}")
            if not isinstance(reply, Hello):
                raise LinkDown(f"peer answered {reply.type!r} instead of hello")
            mine = self._local_hello()
            if reply.model != mine.model:
                self.state = "refused"
                raise LinkDown(f"peer serves model {reply.model!r}, this node {mine.model!r}")
        except BaseException:
            await ws.close()
            raise
        self._ws = ws
        self.peer_hello = reply
        self.state = "up"
        self.last_error = None
        self.connects += 1
        self._up.set()
        log.info("link to %s up: %s layers %s", self.url, reply.node, list(reply.layers))
        self._changed()

    async def _read_until_closed(self) -> None:
        ws = self._ws
        assert ws is not None
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                self._dispatch(message.data)
            elif message.type == aiohttp.WSMsgType.BINARY:
                log.warning("link to %s: unexpected binary frame of %d bytes ignored", self.url, len(message.data))
            elif message.type == aiohttp.WSMsgType.ERROR:
                self.last_error = str(ws.exception())
                break
        if ws.close_code not in (None, 1000):
            self.last_error = f"closed with code {ws.close_code}"

    def _dispatch(self, text: str) -> None:
        try:
            message = decode_control(text)
        except FrameError as exc:
            self._log_limit.log("bad frame", logging.WARNING, "link to %s: bad frame from peer ignored: %s",
                                self.url, exc)
            return
        if isinstance(message, Hello):
            self.peer_hello = message
            self._changed()
            return
        sid = getattr(message, "sid", None)
        callback = self._subscribers.get(sid) if sid else None
        if callback is not None and isinstance(message, (Token, CacheMiss, Error)):
            callback(message)
        elif isinstance(message, Error):
            log.warning("link to %s: peer error: %s", self.url, message.message)

    def _fail_subscribers(self, reason: str) -> None:
        subscribers, self._subscribers = self._subscribers, {}
        for sid, callback in subscribers.items():
            callback(Error(reason, sid=sid, lost=True, url=self.url))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


class LinkPool:
    """The links of one node, one per next-hop URL, dialed on first use and then reused."""

    def __init__(self, factory: Callable[[str], Link]) -> None:
        self._factory = factory
        self._links: dict[str, Link] = {}

    def get(self, url: str) -> Link:
        url = url.rstrip("/")
        link = self._links.get(url)
        if link is None:
            link = self._factory(url)
            self._links[url] = link
            link.start()
        return link

    def all(self) -> list[Link]:
        return list(self._links.values())

    def __contains__(self, url: str) -> bool:
        return url.rstrip("/") in self._links

    def close_idle(self, idle_seconds: float, keep: set[str]) -> list[str]:
        """Close links no session has used for `idle_seconds` (except those in `keep`); their URLs."""
        now = time.monotonic()
        idle = [url for url, link in self._links.items()
                if url not in keep and link.sessions == 0 and now - link.last_used > idle_seconds]
        for url in idle:
            self.discard(url)
        return idle

    def discard(self, url: str) -> None:
        """Forget a next hop (it left the mesh): close its link in the background."""
        link = self._links.pop(url.rstrip("/"), None)
        if link is not None:
            asyncio.ensure_future(link.close())

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
