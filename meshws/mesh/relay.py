"""The head's relay, for a hop where neither side can be dialed (a middle and the tail after it, both behind NAT).

The tail keeps a socket dialed to the head for each such middle (`/mesh/reverse/<tail>/<middle>`: a relay-back,
waiting); the middle's link to the tail dials the head's `/mesh/relay/<tail>/<middle>` instead of the tail
(`Link.relay_via`), and the head pipes the two sockets together message by message. The middle and the tail trade
hellos, session frames and their MACs end to end; the head reads only their sizes (`meshws_frame_bytes` with
direction `relayed`). What it costs the head is in the open and capped: RELAYS pipes at once, WAITING relay-back
sockets per pair, one message in flight each way, and only between joined nodes it could not dial itself. It
dials nobody for a relay, so a relay cannot be pointed at any other address.
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


class Relay:
    def __init__(self, allowed: Callable[[str, str], bool], relayed: Callable[[int], None],
                 max_frame_bytes: int) -> None:
        self.allowed = allowed  # may (tail, middle) be relayed: both joined, neither dialable by this head?
        self.relayed = relayed  # counts the bytes piped
        self.max_frame_bytes = max_frame_bytes
        self.waiting: dict[tuple[str, str], list[tuple[web.WebSocketResponse, asyncio.Future]]] = {}
        self.pipes = 0
        self._arrived = asyncio.Condition()

    def describe(self) -> dict[str, Any]:
        return {"pipes": self.pipes, "waiting": sum(len(backs) for backs in self.waiting.values()),
                "limit": RELAYS}

    async def wait_back(self, request: web.Request, tail: str, middle: str) -> web.WebSocketResponse:
        """The tail's relay-back socket: kept until a middle's relay request takes it, and while the pipe runs."""
        backs = self.waiting.setdefault((tail, middle), [])
        backs[:] = [(ws, done) for ws, done in backs if not ws.closed]
        if not self.allowed(tail, middle) or len(backs) >= WAITING:
            raise web.HTTPForbidden(text="no relay between those nodes (not both joined and undialable, or enough "
                                         "sockets wait already)")
        ws = web.WebSocketResponse(max_msg_size=2 * self.max_frame_bytes + 65536)  # (no heartbeat while it waits)
        await ws.prepare(request)
        done = asyncio.get_running_loop().create_future()
        backs.append((ws, done))
        async with self._arrived:
            self._arrived.notify_all()
        try:
            await done
        finally:
            if (ws, done) in backs:
                backs.remove((ws, done))
            if not ws.closed:
                await ws.close()
        return ws

    async def join(self, request: web.Request, tail: str, middle: str) -> web.WebSocketResponse:
        """The middle's side: its socket piped to a relay-back socket of the tail's, until either closes."""
        if not self.allowed(tail, middle):
            raise web.HTTPForbidden(text="no relay between those nodes (not both joined and undialable)")
        if self.pipes >= RELAYS:
            raise web.HTTPServiceUnavailable(text=f"this head relays {RELAYS} links at once already")
        back = await self._take_back(tail, middle)
        if back is None:
            raise web.HTTPServiceUnavailable(text="the tail has no socket waiting for a relay; try again")
        back_ws, done = back
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=2 * self.max_frame_bytes + 65536)
        self.pipes += 1
        try:
            await ws.prepare(request)
            log.info("relaying the link %s -> %s (neither can dial the other)", middle, tail)
            pumps = [asyncio.create_task(self._pump(ws, back_ws)), asyncio.create_task(self._pump(back_ws, ws))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self.pipes -= 1
            if not done.done():
                done.set_result(None)
            if not ws.closed:
                await ws.close()
        return ws

    async def _take_back(self, tail: str, middle: str) -> tuple[web.WebSocketResponse, asyncio.Future] | None:
        async def ready() -> tuple[web.WebSocketResponse, asyncio.Future] | None:
            backs = self.waiting.get((tail, middle), [])
            while backs:
                ws, done = backs.pop(0)
                if not ws.closed and not done.done():
                    return ws, done
            return None

        try:
            async with asyncio.timeout(PAIR_WAIT):
                async with self._arrived:
                    while (back := await ready()) is None:
                        await self._arrived.wait()
                    return back
        except TimeoutError:
            return None

    async def _pump(self, source: web.WebSocketResponse, sink: web.WebSocketResponse) -> None:
        """Messages from `source` to `sink` as they come, one at a time (the sink's pace holds the source back)."""
        async for message in source:
            if message.type == WSMsgType.TEXT:
                await sink.send_str(message.data)
            elif message.type == WSMsgType.BINARY:
                await sink.send_bytes(message.data)
            else:
                break
            self.relayed(len(message.data))
