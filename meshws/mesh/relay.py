"""The head's relay, for a hop where neither side can be dialed (a middle and the tail after it, both behind NAT).

The tail keeps a socket dialed to the head for each such middle (`/mesh/reverse/<tail>/<middle>`: a relay-back,
waiting); the middle's link to the tail dials the head's `/mesh/relay/<tail>/<middle>` instead of the tail
(`Link.relay_via`), and the head pipes the two sockets together message by message. The middle and the tail trade
hellos and session frames end to end (routes signed by the head included); the head reads only their sizes
(`meshws_frame_bytes` with direction `relayed`). What it costs the head is in the open and capped: RELAYS pipes at
once, WAITING relay-back sockets per pair, one message in flight each way, and only between joined nodes it could not
dial itself. It dials nobody for a relay, so a relay cannot be pointed at any other address.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiohttp import WSMsgType, web

log = logging.getLogger("meshws.relay")

RELAYS = 32  # pipes a head runs at once
WAITING = 2  # relay-back sockets a head keeps waiting per (tail, middle)
PAIR_WAIT = 10.0  # seconds a middle's relay request waits for the tail's relay-back socket


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
        self.pipes = 0
        self._arrived = asyncio.Condition()

    def describe(self) -> dict[str, Any]:
        return {"pipes": self.pipes, "waiting": sum(len(backs) for backs in self.waiting.values()),
                "limit": RELAYS}

    async def wait_back(self, request: web.Request, tail: str, middle: str) -> web.WebSocketResponse:
        """The tail's relay-back socket: kept until a middle's relay request takes it, and while the pipe runs (its
        heartbeats answered all along, so a tail gone silent is seen)."""
        if not self.allowed(tail, middle) or len(self.waiting.get((tail, middle), [])) >= WAITING:
            raise web.HTTPForbidden(text="no relay between those nodes (not both joined and undialable, or enough "
                                         "sockets wait already)")
        backs = self.waiting.setdefault((tail, middle), [])
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=2 * self.max_frame_bytes + 65536)
        back = _Back(ws)
        backs.append(back)  # (counted before the handshake's await: requests at once cannot pass the cap)
        try:
            await ws.prepare(request)
            async with self._arrived:
                self._arrived.notify_all()
            async for message in ws:
                if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY) or not await self._handed(back, message):
                    break
        finally:
            back.closed = True
            if back in backs:
                backs.remove(back)
            if not backs:
                self.waiting.pop((tail, middle), None)
            if back.taken:
                await self._handed(back, None)
                await back.done  # the pipe ends now that this side has
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
        if not self.allowed(tail, middle):
            raise web.HTTPForbidden(text="no relay between those nodes (not both joined and undialable)")
        if self.pipes >= RELAYS:
            raise web.HTTPServiceUnavailable(text=f"this head relays {RELAYS} links at once already")
        self.pipes += 1  # (counted before any await: requests at once cannot pass the cap)
        back = None
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=2 * self.max_frame_bytes + 65536)
        try:
            back = await self._take_back(tail, middle)
            if back is None:
                raise web.HTTPServiceUnavailable(text="the tail has no socket waiting for a relay; try again")
            await ws.prepare(request)
            log.info("relaying the link %s -> %s (neither can dial the other)", middle, tail)
            pumps = [asyncio.create_task(self._to_tail(ws, back)), asyncio.create_task(self._to_middle(back, ws))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self.pipes -= 1
            if back is not None:
                if not back.done.done():
                    back.done.set_result(None)
                if not back.ws.closed:
                    await back.ws.close()
            if not ws.closed and ws.prepared:
                await ws.close()
        return ws

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
