"""The head's relay (mesh/relay.py) on a real aiohttp server: it pipes a tail's relay-back socket and a middle's
link message by message, counts the bytes, and holds its caps: pairs it may not relay, waiting sockets per pair,
pipes at once, and a middle with no tail socket to pair with."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from meshws.mesh import relay as relay_module
from meshws.mesh.relay import RELAYS, WAITING, Relay

TAIL, MIDDLE = "ws://10.0.0.3:1", "ws://10.0.0.2:1"


@pytest.fixture
async def served():
    """A Relay behind /back (the tail's sockets) and /pipe (the middle's), on a free loopback port."""
    counted = []
    allowed = {(TAIL, MIDDLE)}
    relay = Relay(lambda tail, middle: (tail, middle) in allowed, counted.append, max_frame_bytes=1 << 20)
    app = web.Application()

    async def back(request):
        return await relay.wait_back(request, *_pair(request))

    async def pipe(request):
        return await relay.join(request, *_pair(request))

    app.router.add_get("/back/{t}/{m}", back)
    app.router.add_get("/pipe/{t}/{m}", pipe)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with aiohttp.ClientSession() as client:
        yield relay, client, f"http://127.0.0.1:{port}", counted
    await runner.cleanup()


def _pair(request):
    names = {"t": TAIL, "m": MIDDLE, "x": "ws://203.0.113.9:1"}
    return names[request.match_info["t"]], names[request.match_info["m"]]


async def test_a_pipe_carries_both_ways_and_counts_what_it_carried(served):
    relay, client, url, counted = served
    back = await client.ws_connect(f"{url}/back/t/m")
    await asyncio.sleep(0.05)
    middle = await client.ws_connect(f"{url}/pipe/t/m")
    await middle.send_str("hello from the middle")
    assert (await back.receive(timeout=5)).data == "hello from the middle"
    await back.send_bytes(b"\x01" * 3000)
    assert (await middle.receive(timeout=5)).data == b"\x01" * 3000
    assert relay.describe()["pipes"] == 1 and sum(counted) == len("hello from the middle") + 3000
    await back.close()  # one side gone: the other is closed too, the pipe ends
    assert (await middle.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await middle.close()
    await asyncio.sleep(0.05)
    assert relay.describe()["pipes"] == 0


async def _status(client, url):
    try:
        ws = await client.ws_connect(url)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status, None
    return 101, ws


async def test_the_relay_refuses_pairs_it_may_not_relay_and_holds_its_caps(served, monkeypatch):
    relay, client, url, _ = served
    assert (await _status(client, f"{url}/back/x/m"))[0] == 403  # a stranger's address
    assert (await _status(client, f"{url}/pipe/t/x"))[0] == 403
    kept = await asyncio.gather(*(_status(client, f"{url}/back/t/m") for _ in range(WAITING + 3)))  # at once
    assert sorted(status for status, _ in kept) == [101] * WAITING + [403] * 3
    for _, ws in kept:
        if ws is not None:
            await ws.close()
    await asyncio.sleep(0.1)  # (the relay reads its waiting sockets: it sees them close)
    assert relay.describe()["waiting"] == 0
    monkeypatch.setattr(relay_module, "PAIR_WAIT", 0.2)
    assert (await _status(client, f"{url}/pipe/t/m"))[0] == 503  # no tail socket waits (they were closed)
    relay.pipes = RELAYS
    assert (await _status(client, f"{url}/pipe/t/m"))[0] == 503  # as many pipes as it runs at once
