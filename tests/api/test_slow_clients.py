"""Clients that stop reading (on fake shards): an SSE stream and a /ws/chat socket are dropped once a
write waits longer than --write-timeout, and the generation's session is released everywhere."""

import base64
import os
import socket
import struct

import orjson

from fakes import CachedHeadBackend, LoopTailBackend, eventually, fake_mesh
from meshws.model.backend import TailTokenResult


class EndlessTail(LoopTailBackend):
    """' a' for ever: only max_tokens, or a dropped client, ends a generation."""

    def answer(self, past_len):
        return TailTokenResult(" a", 1)


def stalled_socket(port: int, request: bytes) -> socket.socket:
    """A connection that sends `request` and then never reads (its receive buffer kept tiny)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def sse_request(port: int) -> bytes:
    body = orjson.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2000, "stream": True})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def ws_chat_request(port: int) -> bytes:
    """A websocket upgrade for /ws/chat and, right behind it, one masked text frame starting a turn."""
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (f"GET /ws/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    payload = orjson.dumps({"type": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000})
    mask = os.urandom(4)
    masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
    return upgrade + bytes([0x81, 0x80 | 126]) + struct.pack(">H", len(payload)) + mask + masked


async def _dropped_and_released(request_for, tail: EndlessTail) -> None:
    async with fake_mesh(CachedHeadBackend(), tail, write_timeout=0.5) as mesh:
        sock = stalled_socket(mesh.head_port, request_for(mesh.head_port))
        try:
            await eventually(lambda: mesh.head.health()["generations"] == 1, timeout=5)
            await eventually(lambda: mesh.tail.health()["channels"] == 1, timeout=5)
            await eventually(lambda: mesh.head.health()["generations"] == 0, timeout=15)
            await eventually(lambda: mesh.tail.health()["channels"] == 0, timeout=5)
            assert len(tail.calls) < 1500  # dropped mid-answer, not served to the end
            assert mesh.head.health()["sessions"] == 0
        finally:
            sock.close()


async def test_an_sse_client_that_stops_reading_is_dropped_and_its_session_released():
    await _dropped_and_released(sse_request, EndlessTail())


async def test_a_ws_chat_client_that_stops_reading_is_dropped_and_its_session_released():
    await _dropped_and_released(ws_chat_request, EndlessTail())
