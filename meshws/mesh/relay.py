"""The head's relay, for a hop where neither side can be dialed (a middle and the tail after it, both behind NAT).

The tail keeps a socket dialed to the head for each such middle (`/mesh/reverse/<tail>/<middle>`: a relay-back,
waiting); the middle's link to the tail dials the head's `/mesh/relay/<tail>/<middle>` instead of the tail
(`Link.relay_via`), and the head pipes the two sockets together message by message. The middle and the tail trade
hellos and session frames end to end (routes signed by the head included), sealed by the two ends (`mesh.seal`: a
frame altered on the way closes the link); the head counts their sizes (`meshws_frame_bytes` with direction
`relayed`), and each socket proves the key of the node it stands for (`mesh.reverse`). What it costs the head is in
the open and capped: RELAYS pipes at once, WAITING relay-back sockets and WAITING middles' requests per pair and
RELAYS of each in all (a request waiting for its pair holds no pipe), one message in flight each way, a tail's
messages of at most BACK_MESSAGE_BYTES (it sends control frames alone), nothing at all from a socket not yet paired
(it is closed), and only between two distinct, adjacent joined nodes it could not dial itself. It dials nobody for
a relay, so a relay cannot be pointed at any other address. When the last pipe and socket go, the heap's free pages
go back to the system.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiohttp import WSMsgType, web

from ..model.memory import give_back

log = logging.getLogger("meshws.relay")

RELAYS = 32  # pipes a head runs at once
WAITING = 2  # relay-back sockets a head keeps waiting per (tail, middle), and middles' requests waiting for them
PAIR_WAIT = 10.0  # seconds a middle's relay request waits for the tail's relay-back socket
BACK_MESSAGE_BYTES = 2 * 1024 * 1024  # a tail's messages: tokens and errors (control frames are at most 1 MiB)


class _Back:
    """A tail's relay-back socket, read by its own task from the start (so a close is seen while it waits); what
    it sends waits in `inbox`, one message at most."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.inbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)  # messages, then None when it closed
        self.taken = False  # paired with a middle's socket
        self.closed = False
        self.done = asyncio.get_running_loop().create_future()  # the pipe it was taken for has ended


class Relay:
    def __init__(self, allowed: Callable[[str, str], bool], relayed: Callable[[int], None],
                 max_frame_bytes: int) -> None:
        self.allowed = allowed  # may (tail, middle) be relayed: both joined, neither dialable by this head?
        self.relayed = relayed  # counts the bytes piped
        self.max_frame_bytes = max_frame_bytes
        self.waiting: dict[tuple[str, str], list[_Back]] = {}
        self.joining: dict[tuple[str, str], int] = {}  # middles' requests waiting for a relay-back socket, per pair
        self.pipes = 0
        self._arrived = asyncio.Condition()

    def describe(self) -> dict[str, Any]:
        return {"pipes": self.pipes, "waiting": self._waiting(), "joining": sum(self.joining.values()),
                "limit": RELAYS}

    def _waiting(self) -> int:
        return sum(len(backs) for backs in self.waiting.values())

    async def wait_back(self, request: web.Request, tail: str, middle: str) -> web.WebSocketResponse:
        """The tail's relay-back socket: kept until a middle's relay request takes it, and while the pipe runs (its
        heartbeats answered all along, so a tail gone silent is seen)."""
        if tail == middle or not self.allowed(tail, middle) or len(self.waiting.get((tail, middle), [])) >= WAITING \
                or self._waiting() >= RELAYS:
            raise web.HTTPForbidden(text="no relay between those nodes (not two adjacent nodes both joined and "
                                         "undialable, or enough sockets wait already)")
        backs = self.waiting.setdefault((tail, middle), [])
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=BACK_MESSAGE_BYTES)
        back = _Back(ws)
        backs.append(back)  # (counted before the handshake's await: requests at once cannot pass the cap)
        try:
            await ws.prepare(request)
            async with self._arrived:
                self._arrived.notify_all()
            async for message in ws:
                if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY) or not back.taken \
                        or not await self._handed(back, message):
                    break  # (a tail speaks only once a middle's hello came through it: not while it waits)
        finally:
            back.closed = True
            if back in backs:
                backs.remove(back)
            if not backs and self.waiting.get((tail, middle)) is backs:  # (a newer list may stand there now)
                del self.waiting[(tail, middle)]
            if back.taken:
                await self._handed(back, None)
                await back.done  # the pipe ends now that this side has
            if not ws.closed:
                await ws.close()
            self._idle()
        return ws

    @staticmethod
    async def _handed(back: _Back, message: Any) -> bool:
        """`message` into the back socket's inbox, unless its pipe ends first (then nobody will read it)."""
        put = asyncio.ensure_future(back.inbox.put(message))
        await asyncio.wait([put, back.done], return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            return False
        return True

    async def join(self, request: web.Request, tail: str, middle: str) -> web.WebSocketResponse:
        """The middle's side: its socket piped to a relay-back socket of the tail's, until either closes."""
        if tail == middle or not self.allowed(tail, middle):
            raise web.HTTPForbidden(text="no relay between those nodes (not two adjacent nodes both joined and "
                                         "undialable)")
        pair = (tail, middle)
        if self.pipes >= RELAYS or self.joining.get(pair, 0) >= WAITING or sum(self.joining.values()) >= RELAYS:
            raise web.HTTPServiceUnavailable(text=f"this head relays {RELAYS} links at once already, or enough "
                                                  "requests wait for this pair")
        self.joining[pair] = self.joining.get(pair, 0) + 1  # (counted before any await: requests at once cannot
        try:  # pass the cap; a request that waits for its pair holds no pipe)
            back = await self._take_back(tail, middle)
        finally:
            self.joining[pair] -= 1
            if not self.joining[pair]:
                del self.joining[pair]
        if back is None:
            self._idle()
            raise web.HTTPServiceUnavailable(text="the tail has no socket waiting for a relay; try again")
        if self.pipes >= RELAYS:  # (filled while this one waited: the socket it took goes back to its tail)
            back.done.set_result(None)
            await back.ws.close()
            raise web.HTTPServiceUnavailable(text=f"this head relays {RELAYS} links at once already")
        self.pipes += 1
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=self.max_frame_bytes + 65536)
        try:
            await ws.prepare(request)
            log.info("relaying the link %s -> %s (neither can dial the other)", middle, tail)
            pumps = [asyncio.create_task(self._to_tail(ws, back)), asyncio.create_task(self._to_middle(back, ws))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self.pipes -= 1
            if not back.done.done():
                back.done.set_result(None)
            if not back.ws.closed:
                await back.ws.close()
            if not ws.closed and ws.prepared:
                await ws.close()
            self._idle()
        return ws

    def _idle(self) -> None:
        """Nothing relayed or waiting any more: the buffers the pipes used go back to the system."""
        if not self.pipes and not self.waiting and not self.joining:
            give_back()

    async def _take_back(self, tail: str, middle: str) -> _Back | None:
        def ready() -> _Back | None:
            backs = self.waiting.get((tail, middle), [])
            while backs:
                back = backs.pop(0)
                if not back.closed:
                    back.taken = True
                    return back
            return None

        try:
            async with asyncio.timeout(PAIR_WAIT):
                async with self._arrived:
                    while (back := ready()) is None:
                        await self._arrived.wait()
                    return back
        except TimeoutError:
            return None

    async def _to_tail(self, source: web.WebSocketResponse, back: _Back) -> None:
        """The middle's messages to the tail as they come, one at a time (the tail's pace holds the middle back)."""
        async for message in source:
            if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                break
            await self._send(back.ws, message)

    async def _to_middle(self, back: _Back, sink: web.WebSocketResponse) -> None:
        while (message := await back.inbox.get()) is not None:
            await self._send(sink, message)

    async def _send(self, sink: web.WebSocketResponse, message: Any) -> None:
        if message.type == WSMsgType.TEXT:
            await sink.send_str(message.data)
        else:
            await sink.send_bytes(message.data)
        self.relayed(len(message.data))
