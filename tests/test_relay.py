"""The delaying relay the benchmark and the speculation tests use as a long link: each direction its own delay."""

import asyncio
import time

from meshws.tools.relay import DelayRelay


async def _echo(reader, writer):
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(delay, delay_back):
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    relay = DelayRelay("127.0.0.1", server.sockets[0].getsockname()[1], delay, delay_back)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", await relay.start())
        began = time.monotonic()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        elapsed = time.monotonic() - began
        writer.close()
        return elapsed
    finally:
        await relay.stop()
        server.close()
        await server.wait_closed()


async def test_each_direction_takes_its_own_delay():
    to_target = await _round_trip(0.2, 0.0)
    back = await _round_trip(0.0, 0.2)
    both = await _round_trip(0.2, None)  # one delay: both ways
    assert 0.2 <= to_target < 0.38 and 0.2 <= back < 0.38  # one way delayed, not both
    assert both >= 0.4
