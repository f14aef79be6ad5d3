"""A relayed hop's frames sealed between its two ends (issue 61): whoever pipes them cannot alter, replay or
reorder them unseen, and only the keys the head named can seal.

Real aiohttp websockets on loopback; the one who pipes is a shim on the dialer's socket that changes what it
sends (the relay it stands for only copies frames)."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from helpers import serving
from meshws.mesh.identity import NodeIdentity
from meshws.mesh.seal import SealBroken, seal_answerer, seal_dialer

MIDDLE, TAIL = "ws://middle.example:1", "ws://tail.example:2"


class Piped:
    """The dialer's socket as a relay would carry it: `change` may rewrite each binary frame sent (None drops it);
    `hold` keeps frames to send later (out of order, or again)."""

    def __init__(self, ws, change=None):
        self.ws, self.change, self.sent = ws, change, []

    async def send_str(self, data):
        await self.ws.send_str(data)

    async def send_bytes(self, data):
        self.sent.append(bytes(data))
        data = self.change(bytes(data)) if self.change else data
        if data is not None:
            await self.ws.send_bytes(data)

    def __getattr__(self, name):
        return getattr(self.ws, name)


@pytest.fixture
async def hop():
    """A tail's end on a real server: it seals as the answerer, then echoes what it receives (text as text,
    binary as binary) and records how its socket ended."""
    tail, middle = NodeIdentity.generate(), NodeIdentity.generate()
    ended = asyncio.get_running_loop().create_future()
    expected = {"key": middle.public_hex}

    async def handle(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        try:
            sealed = await seal_answerer(ws, tail, TAIL, MIDDLE, expected["key"])
        except SealBroken as exc:
            ended.set_result(("refused", str(exc)))
            await ws.close(code=1008)
            return ws
        async for message in sealed:
            if message.type == aiohttp.WSMsgType.TEXT:
                await sealed.send_str("echo " + message.data)
            elif message.type == aiohttp.WSMsgType.BINARY:
                await sealed.send_bytes(message.data[::-1])
            else:
                break
        if not ended.done():
            ended.set_result(("closed", sealed.broken))
        return ws

    app = web.Application()
    app.router.add_get("/ws", handle)
    async with serving(app) as base, aiohttp.ClientSession() as client:
        yield {"url": f"{base}/ws", "client": client, "tail": tail, "middle": middle, "ended": ended,
               "expected": expected}


async def test_a_sealed_hop_carries_text_and_binary_both_ways(hop):
    ws = await hop["client"].ws_connect(hop["url"])
    sealed = await seal_dialer(ws, hop["middle"], MIDDLE, TAIL, hop["tail"].public_hex)
    for n in range(3):
        await sealed.send_str(f"hello {n}")
        assert (await sealed.receive(timeout=5)).data == f"echo hello {n}"
        await sealed.send_bytes(b"\x00\x01rows" * (n + 1))
        answer = await sealed.receive(timeout=5)
        assert answer.type == aiohttp.WSMsgType.BINARY and answer.data == (b"\x00\x01rows" * (n + 1))[::-1]
    await sealed.close()


@pytest.mark.parametrize("change", ["flip a payload bit", "replay the first frame", "drop one", "plain text"])
async def test_a_frame_changed_on_the_way_closes_the_hop(hop, change):
    ws = await hop["client"].ws_connect(hop["url"])
    sealed = await seal_dialer(ws, hop["middle"], MIDDLE, TAIL, hop["tail"].public_hex)
    await sealed.send_str("first")
    assert (await sealed.receive(timeout=5)).data == "echo first"
    piped = Piped(ws)
    sealed.ws = piped  # (from here on every frame goes through the pipe that changes it)
    if change == "flip a payload bit":
        piped.change = lambda data: data[:-1] + bytes([data[-1] ^ 1])
        await sealed.send_str("second")
    elif change == "replay the first frame":
        await sealed.send_str("second")
        assert (await sealed.receive(timeout=5)).data == "echo second"
        await ws.send_bytes(piped.sent[0])  # (the second frame again, in its own words)
    elif change == "drop one":
        piped.change = lambda data: None if len(piped.sent) == 1 else data
        await sealed.send_str("second")  # (dropped)
        await sealed.send_str("third")  # (its count no longer matches the tail's)
    else:
        await ws.send_str("echo me")  # an unsealed frame in a sealed hop
    closing = await ws.receive(timeout=5)  # (no echo: the tail closes the hop)
    assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1008, closing
    ended = await asyncio.wait_for(hop["ended"], 5)
    assert ended[0] == "closed" and "failed its MAC" in ended[1], ended


async def test_a_seal_by_another_key_than_the_head_named_is_refused_both_ways(hop):
    impostor = NodeIdentity.generate()
    ws = await hop["client"].ws_connect(hop["url"])
    with pytest.raises(SealBroken):
        await seal_dialer(ws, impostor, MIDDLE, TAIL, hop["tail"].public_hex)  # the tail expects the middle's key
    assert (await asyncio.wait_for(hop["ended"], 5))[0] == "refused"
    assert ws.closed


async def test_the_dialer_refuses_a_tail_that_is_not_the_one_named(hop):
    ws = await hop["client"].ws_connect(hop["url"])
    with pytest.raises(SealBroken, match="another key"):
        await seal_dialer(ws, hop["middle"], MIDDLE, TAIL, NodeIdentity.generate().public_hex)
    assert ws.closed


async def test_a_seal_made_for_another_hop_does_not_verify(hop):
    # The middle's signature covers both URLs: a seal it made for another tail is no seal for this one.
    ws = await hop["client"].ws_connect(hop["url"])
    with pytest.raises(SealBroken):
        await seal_dialer(ws, hop["middle"], MIDDLE, "ws://another-tail.example:3", hop["tail"].public_hex)
    ended = await asyncio.wait_for(hop["ended"], 5)
    assert ended == ("refused", "the other end's seal is not signed by its key for this hop")


def test_a_link_that_never_dialed_describes_itself():
    from meshws.mesh.link import Link

    link = Link("ws://tail.example:2", lambda: None, max_frame_bytes=1 << 20)
    link.relay_via = ("http://head.example:1", "/mesh/relay/x/y")  # (as a middle's link is, before its first dial)
    assert link.describe()["formed"] == "relayed by http://head.example:1 (neither side can dial the other)"


async def test_without_a_named_key_nothing_is_sealed(hop):
    hop["expected"]["key"] = None
    ws = await hop["client"].ws_connect(hop["url"])
    with pytest.raises(SealBroken):
        await seal_dialer(ws, hop["middle"], MIDDLE, TAIL, hop["tail"].public_hex)
    assert (await asyncio.wait_for(hop["ended"], 5)) == \
        ("refused", "no key is known for the other end of this relayed hop (its head has not named one)")
