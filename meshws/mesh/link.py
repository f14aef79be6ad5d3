"""A link: one persistent websocket from this node to a next hop, shared by all sessions.

The link dials `/ws/shard`, trades `hello` frames (protocol version, model id,
layer range and the chain behind the peer), keeps itself alive with websocket
heartbeats and re-dials with backoff when it drops. Replies arrive as control
frames and are handed to whoever subscribed to their `sid`; when the link
drops, every subscriber is told so with an `error` frame marked `lost`.

A peer nobody can dial (behind NAT) dials us instead (`mesh.reverse`): the websocket it
opens is `offer`ed to its link, which from then on waits for such offers rather than
dialing. Hellos, frames, signed routes and losses are the same either way; only who dialed differs.
The secret authenticates each dial; a relayed link's frames are sealed by its two ends (`mesh.seal`), other
frames carry no MAC of their own: across a network that is not trusted only TLS keeps them from being read or
altered (docs/operating.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl as ssl_module
import time
from typing import Any, Callable

import aiohttp

from .aio import no_way_to, waited
from .auth import signed_headers
from .log_limit import LogLimiter
from ..model.backend import TensorPayload
from .rows import RowOutbox, travels_in_waves
from .seal import seal_dialer
from .wire import (CacheMiss, ControlMessage, DecodeRow, Error, FrameError, Hello, KVAck, SessionReply, Token,
                   decode_control, encode_control, encode_forward)

log = logging.getLogger("meshws.link")

DIAL_TIMEOUT = 5.0  # seconds a dial may take to connect

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
        identity: Any = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._identity = identity  # this node's key (`mesh.identity`): a relay checks the dialer is who it says
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
        self._rows = RowOutbox(self._send, lambda why: LinkDown(f"link to {self.url}: {why}"))  # a wave: one frame
        self.dial_failures = 0  # dials in a row that found no way to the peer (not one refused: that peer is down)
        self.reversed = False  # the peer dials us (`offer`): it cannot be dialed
        self.relay_via: tuple[str, str] | None = None  # (head, path): neither side can dial, a head relays
        self.relay_seal: tuple[str, str | None] | None = None  # (this node's URL, the peer's key): `mesh.seal`
        self.sealed = False  # the socket in use was sealed by the two ends (a relayed one)
        self._offers: asyncio.Queue[tuple[Any, asyncio.Future]] = asyncio.Queue()
        self._log_limit = LogLimiter(log)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._dial_forever(), name=f"link {self.url}")

    def offer(self, ws: Any) -> asyncio.Future:
        """A websocket the peer dialed to this node (it cannot be dialed): the link runs over it. The future is done
        when the link no longer uses it (the caller, which holds the socket open, may then close it)."""
        done = asyncio.get_running_loop().create_future()
        if self.state == "closed" or (self.reversed and self.is_up) or self._offers.qsize() >= 2:
            done.set_result(None)  # (an up link is not taken over by another socket; two waiting are plenty)
            return done
        self._offers.put_nowait((ws, done))
        if not self.reversed:  # from now on the peer dials: stop dialing it
            self.reversed = True
            if self._task is not None:
                self._task.cancel()
            self._task = asyncio.create_task(self._take_offers(), name=f"reverse link {self.url}")
        return done

    async def wait_up(self, timeout: float) -> bool:
        return await waited(self._up, timeout)

    @property
    def is_up(self) -> bool:
        return self.state == "up" and self._ws is not None and not self._ws.closed

    async def close(self) -> None:
        self.state = "closed"
        while not self._offers.empty():
            ws, done = self._offers.get_nowait()
            if not done.done():
                done.set_result(None)
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

    def _down(self) -> LinkDown:
        """Why nothing can be sent: a link that was up and dropped says `lost`, as its subscribers heard."""
        if self.connects:
            return LinkDown(f"link to {self.url} lost ({self.last_error or self.state})")
        return LinkDown(f"link to {self.url} is {self.status()}")

    def describe(self) -> dict[str, Any]:
        peer = self.peer_hello
        return {
            "url": self.url,
            "state": self.state,
            "peer": peer.node if peer else None,
            "layers": list(peer.layers) if peer else None,
            "sessions": len(self._subscribers),
            "connects": self.connects,
            "formed": "reversed: the peer dials this node (it could not be dialed)" if self.reversed else
            f"relayed by {self.relay_via[0]} (neither side can dial the other{'; sealed' if self.sealed else ''})"
            if self.relay_via else "dialed",
            "error": self.last_error,
            "wave_frames": self._rows.frames,  # frames that carried several sessions' decode steps
            "wave_rows": self._rows.rows,
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
        await self._rows.flush()  # (rows handed over before it leave before it)
        await self._send(encode_control(message))

    async def send_frame(self, data: bytes) -> None:  # a binary frame built elsewhere (a standby's `kv` rows)
        await self._send(data)

    async def send_step(self, sid: str, step: int, mode: str, payload: TensorPayload, ids: list[int] | None,
                        drafts: tuple[int, ...], compress_min_bytes: int) -> int:
        """A step's hidden states for the peer: a plain decode row with the rest of its wave (`RowOutbox`), any
        other step as a frame of its own. Returns the bytes it took on the wire (a row: its share of its frame)."""
        if travels_in_waves(mode, payload.shape, ids, drafts):
            if not self.is_up:
                raise self._down()
            row = DecodeRow(sid=sid, step=step, past_len=payload.past_len, body=payload.body, group=payload.group)
            return await self._rows.send(row, payload.shape[-1], payload.dtype, compress_min_bytes)
        data = encode_forward(sid, step, mode, payload.past_len, payload.shape, payload.dtype, payload.body, ids=ids,
                              compress_min_bytes=compress_min_bytes, drafts=drafts, group=payload.group)
        await self._send(data)
        return len(data)

    async def _send(self, data: str | bytes) -> None:
        ws = self._ws
        if ws is None or ws.closed or self.state != "up":
            raise self._down()
        try:
            async with self._send_lock:
                if isinstance(data, bytes):
                    await ws.send_bytes(data)
                else:
                    await ws.send_str(data)
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            raise LinkDown(f"link to {self.url} lost while sending: {exc}") from exc

    # -- the dial loop ------------------------------------------------------

    async def _dial_forever(self) -> None:
        backoff = 0.1
        # (a peer that drops SYNs, behind NAT, is given up on after DIAL_TIMEOUT rather than TCP's two minutes)
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300, sock_connect=DIAL_TIMEOUT))
        while self.state != "closed":
            self.state = "connecting"
            try:
                try:
                    await self._connect_once()
                except Exception as exc:
                    self.dial_failures = self.dial_failures + 1 if no_way_to(exc) else 0
                    raise
                backoff, self.dial_failures = 0.1, 0
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

    async def _take_offers(self) -> None:
        """The reversed link: each socket the peer dials in, in turn (the peer re-dials when one drops)."""
        while self.state != "closed":
            self.state = "down" if self.connects else "connecting"
            ws, done = await self._offers.get()
            try:
                await self._greet(ws)
                await self._read_until_closed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            finally:
                was_up = self._up.is_set()
                self._up.clear()
                self._ws = None
                if not done.done():
                    done.set_result(None)
                if was_up and self.state != "closed":
                    log.warning("reversed link to %s dropped (%s); waiting for it to dial again", self.url,
                                self.last_error or "closed")
                    self._fail_subscribers(f"link to {self.url} lost ({self.last_error or 'closed'})")
                    self._changed()

    async def _connect_once(self) -> None:
        assert self._client is not None
        base, path = self.relay_via or (self.url, "/ws/shard")
        headers = await signed_headers(self._client, base, self._secret, "GET", path, ssl=self._ssl,
                                       identity=self._identity)
        self.sealed = False
        ws = await self._client.ws_connect(
            f"{base}{path}",
            heartbeat=self._heartbeat,
            max_msg_size=self._max_frame_bytes + 65536,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
            headers=headers,
            ssl=self._ssl,
        )
        if self.relay_via and self._identity is not None and self.relay_seal is not None:  # (through a head's
            ws = await seal_dialer(ws, self._identity, self.relay_seal[0], self.url, self.relay_seal[1])  # relay)
            self.sealed = True
        await self._greet(ws)

    async def _greet(self, ws: Any) -> None:
        """Hellos traded on a new socket (ours first); the link is up on it, or the socket closed and why raised."""
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
        if callback is not None and isinstance(message, (Token, CacheMiss, Error, KVAck)):
            callback(message)
        elif isinstance(message, Error):
            log.warning("link to %s: peer error: %s", self.url, message.message)

    def _fail_subscribers(self, reason: str) -> None:
        subscribers, self._subscribers = self._subscribers, {}
        for sid, callback in subscribers.items():
            callback(Error(message=reason, sid=sid, lost=True, url=self.url))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)
