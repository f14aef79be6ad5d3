"""The head's relay (mesh/relay.py) on a real aiohttp server: it pipes a tail's relay-back socket and a middle's
link message by message, counts the bytes, and holds its caps: pairs it may not relay, waiting sockets per pair,
pipes at once, and a middle with no tail socket to pair with."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from helpers import serving
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
    async with serving(app) as base, aiohttp.ClientSession() as client:
        yield relay, client, base, counted


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


async def test_a_pair_of_one_node_with_itself_is_refused(served):
    relay, client, url, _ = served
    relay.allowed = lambda tail, middle: True
    assert (await _status(client, f"{url}/back/t/t"))[0] == 403
    assert (await _status(client, f"{url}/pipe/m/m"))[0] == 403


async def test_a_waiting_socket_that_speaks_before_it_is_paired_is_closed(served):
    relay, client, url, _ = served
    back = await client.ws_connect(f"{url}/back/t/m")
    await asyncio.sleep(0.05)
    await back.send_bytes(b"\x00" * 1000)  # (a tail says nothing until a middle's hello came through)
    assert (await back.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await asyncio.sleep(0.05)
    assert relay.describe()["waiting"] == 0


async def test_waiting_sockets_are_capped_in_all(served, monkeypatch):
    relay, client, url, _ = served
    monkeypatch.setattr(relay_module, "RELAYS", 1)
    first = await client.ws_connect(f"{url}/back/t/m")
    await asyncio.sleep(0.05)
    assert (await _status(client, f"{url}/back/t/m"))[0] == 403  # one waits, the cap in all
    await first.close()


async def test_a_socket_after_a_replaced_pair_list_is_still_paired(served):
    """A pipe's end must not drop a newer list of waiting sockets for its pair (it would orphan them)."""
    relay, client, url, _ = served
    first = await client.ws_connect(f"{url}/back/t/m")
    await asyncio.sleep(0.05)
    middle = await client.ws_connect(f"{url}/pipe/t/m")  # takes the first socket: its list is now empty
    quick = await client.ws_connect(f"{url}/back/t/m")  # another comes and goes: the empty list is dropped
    await asyncio.sleep(0.05)
    await quick.close()
    await asyncio.sleep(0.05)
    later = await client.ws_connect(f"{url}/back/t/m")  # a new list for the pair
    await asyncio.sleep(0.05)
    await first.close()  # the first pipe ends
    await middle.close()
    await asyncio.sleep(0.1)
    assert relay.describe()["waiting"] == 1  # the later socket still waits where a middle finds it
    again = await client.ws_connect(f"{url}/pipe/t/m")
    await again.send_str("through")
    assert (await later.receive(timeout=5)).data == "through"
    await again.close()
    await later.close()


async def test_middles_waiting_for_a_pair_hold_no_pipe_and_are_capped_per_pair(served, monkeypatch):
    relay, client, url, _ = served
    monkeypatch.setattr(relay_module, "PAIR_WAIT", 1.0)
    waiting = [asyncio.create_task(_status(client, f"{url}/pipe/t/m")) for _ in range(WAITING)]
    await asyncio.sleep(0.1)
    assert relay.describe()["joining"] == WAITING and relay.describe()["pipes"] == 0
    assert (await _status(client, f"{url}/pipe/t/m"))[0] == 503  # a third waits for the same pair: refused at once
    assert sorted(status for status, _ in await asyncio.gather(*waiting)) == [503] * WAITING  # no tail came
    assert relay.describe() == {"pipes": 0, "waiting": 0, "joining": 0, "limit": RELAYS}


def test_only_two_adjacent_joined_undialable_nodes_are_relayed():
    from meshws.mesh import reverse
    from meshws.mesh.reverse import ReverseEndpoint

    spans = {"ws://m:1": (4, 8), "ws://t:1": (8, 12), "ws://far:1": (10, 12)}
    endpoint = ReverseEndpoint(links=None, authorize=lambda request: None, max_frame_bytes=1 << 20,
                               joined=lambda: spans)
    original = reverse.cannot_dial
    reverse.cannot_dial = lambda links, url: True
    try:
        assert endpoint.may_relay("ws://t:1", "ws://m:1")
        assert not endpoint.may_relay("ws://far:1", "ws://m:1")  # not where the middle ends
        assert not endpoint.may_relay("ws://m:1", "ws://m:1")
        assert not endpoint.may_relay("ws://t:1", "ws://stranger:1")
    finally:
        reverse.cannot_dial = original


async def test_a_tail_socket_takes_no_message_above_the_control_frames_size(served):
    """A relay-back socket, paired or not, never buffers a large message (issue 61: 3 x 128 MiB a socket)."""
    relay, client, url, _ = served
    back = await client.ws_connect(f"{url}/back/t/m")
    await asyncio.sleep(0.05)
    middle = await client.ws_connect(f"{url}/pipe/t/m")
    await middle.send_str("hello")
    assert (await back.receive(timeout=5)).data == "hello"
    await back.send_bytes(b"\x00" * (relay_module.BACK_MESSAGE_BYTES + 1))
    closed = await back.receive(timeout=5)
    assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert back.close_code == 1009  # too big: refused as it arrives, not read
    assert (await middle.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await middle.close()
    await asyncio.sleep(0.05)
    assert relay.describe() == {"pipes": 0, "waiting": 0, "joining": 0, "limit": RELAYS}
