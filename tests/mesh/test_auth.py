"""The mesh secret: a header works once, on the node that handed out its nonce, for one request and body."""

import asyncio
import time

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import CachedHeadBackend, LoopTailBackend, wait_ready
from meshws.config import NodeSettings
from meshws.mesh.auth import HEADER, Verifier, sign, sign_route, signed_headers, route_is_signed
from meshws.mesh.identity import NodeIdentity
from meshws.node import Node

SECRET = "right-secret-of-16+"
WRONG = "wrong-secret-of-16+"


def test_a_header_works_once_for_its_node_request_and_body():
    node_a, node_b = Verifier(SECRET), Verifier(SECRET)
    nonce = node_a.challenge()
    header = sign(SECRET, nonce, "POST", "/mesh/join", b'{"a": 1}')
    assert "did not hand out" in node_b.check(header, "POST", "/mesh/join", b'{"a": 1}')  # made for A, shown to B
    assert node_a.check(header, "POST", "/mesh/join", b'{"a": 2}') == "wrong mesh secret"  # another body
    assert node_a.check(header, "POST", "/mesh/join", b'{"a": 1}') is None
    assert "already used" in node_a.check(header, "POST", "/mesh/join", b'{"a": 1}')  # replay
    nonce = node_a.challenge()
    assert "wrong mesh secret" in node_a.check(sign(WRONG, nonce, "GET", "/ws/shard"), "GET", "/ws/shard")
    assert "wrong mesh secret" in node_a.check(sign(SECRET, nonce, "GET", "/mesh/join"), "GET", "/ws/shard")
    assert "wrong mesh secret" in node_a.check(sign(SECRET, nonce, "POST", "/ws/shard"), "GET", "/ws/shard")
    old = sign(SECRET, nonce, "GET", "/ws/shard", now=time.time() - 3600)
    assert "too old" in node_a.check(old, "GET", "/ws/shard")
    assert "missing" in node_a.check(None, "GET", "/ws/shard")
    assert "malformed" in node_a.check("not-a-header", "GET", "/ws/shard")
    assert Verifier(None).check(None, "GET", "/ws/shard") is None  # no secret set: nothing to check here


def test_a_flood_of_challenges_costs_nothing_and_nonces_expire():
    now = [1_000_000.0]
    verifier = Verifier(SECRET, clock=lambda: now[0])
    first = verifier.challenge()
    for _ in range(10_000):  # an attacker asking for nonces all day evicts no honest one
        verifier.challenge()
    assert verifier.check(sign(SECRET, first, "GET", "/p", now=now[0]), "GET", "/p") is None
    assert len(verifier._used) == 1  # only used nonces are remembered, and only holders of the secret use them
    late = verifier.challenge()
    now[0] += 500
    assert "expired" in verifier.check(sign(SECRET, late, "GET", "/p", now=now[0]), "GET", "/p")
    forged = "0" * 56  # the right form, a MAC this node never made
    assert "did not hand out" in verifier.check(sign(SECRET, forged, "GET", "/p", now=now[0]), "GET", "/p")


def test_a_header_can_be_refused_before_the_body_is_read():
    verifier = Verifier(SECRET)
    assert verifier.precheck(sign(SECRET, verifier.challenge(), "POST", "/mesh/join", b"x")) is None
    assert "did not hand out" in verifier.precheck(sign(SECRET, Verifier(SECRET).challenge(), "POST", "/p"))
    assert "missing" in verifier.precheck(None)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=400), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_header_gets_a_reason_never_an_exception(header):
    verifier = Verifier(SECRET)
    verifier.challenge()
    assert isinstance(verifier.check(header, "GET", "/ws/shard"), str)


def test_a_route_signature_covers_the_session_and_every_hop():
    route = [{"url": "ws://127.0.0.1:9001", "layers": [10, 20]}, {"url": "ws://127.0.0.1:9002"}]
    mac = sign_route(SECRET, "sid-1", route)
    assert route_is_signed(SECRET, "sid-1", route, mac)
    assert not route_is_signed(SECRET, "sid-2", route, mac)
    assert not route_is_signed(SECRET, "sid-1", route[:1], mac)
    assert not route_is_signed(WRONG, "sid-1", route, mac)
    assert not route_is_signed(SECRET, "sid-1", route, None)


async def test_a_node_that_cannot_prove_the_secret_is_not_dialed():
    impostor = Node(NodeSettings(role="tail", port=0, layers=(6, 12), secret=WRONG), backend=LoopTailBackend())
    port = await impostor.start()
    try:
        async with aiohttp.ClientSession() as client:
            with pytest.raises(ConnectionError, match="cannot prove"):
                await signed_headers(client, f"http://127.0.0.1:{port}", SECRET, "GET", "/ws/shard")
    finally:
        await impostor.stop()


async def test_links_and_joins_need_the_secret(caplog):
    tail = Node(NodeSettings(role="tail", port=0, layers=(6, 12), secret=SECRET), backend=LoopTailBackend())
    tail_port = await tail.start()
    wrong = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret=WRONG), backend=CachedHeadBackend())
    await wrong.start()
    try:
        await asyncio.sleep(1.0)
        link = wrong.links.all()[0]  # each side finds the other does not know its secret
        assert link.state != "up" and "cannot prove" in (link.last_error or "")
        assert not wrong.health()["ready"]
        assert tail.health()["inbound_links"] == 0
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{tail_port}/ws/shard") as response:  # no header at all
                assert response.status == 401
            nonce = (await (await client.get(f"http://127.0.0.1:{tail_port}/mesh/challenge")).json())["nonce"]
            forged = {HEADER: sign(WRONG, nonce, "GET", "/ws/shard")}
            async with client.get(f"http://127.0.0.1:{tail_port}/ws/shard", headers=forged) as response:
                assert response.status == 401 and "wrong mesh secret" in await response.text()
        assert "refused /ws/shard" in caplog.text
    finally:
        await wrong.stop()
    right = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret=SECRET), backend=CachedHeadBackend())
    head_port = await right.start()
    try:
        await wait_ready(head_port)
        url = f"http://127.0.0.1:{head_port}"
        join = b'{"url": "ws://127.0.0.1:1", "node": "x", "model": "fake-model", "layers": [6, 12]}'
        json_type = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{url}/mesh/join", data=join, headers=json_type) as response:
                assert response.status == 401
            nonce = (await (await client.get(f"{url}/mesh/challenge")).json())["nonce"]
            forged = {HEADER: sign(WRONG, nonce, "POST", "/mesh/join", join)}
            async with client.post(f"{url}/mesh/join", data=join, headers={**forged, **json_type}) as response:
                assert response.status == 401
            headers = await signed_headers(client, url, SECRET, "POST", "/mesh/join", join)
            async with client.post(f"{url}/mesh/join", data=join, headers={**headers, **json_type}) as response:
                assert response.status == 401 and "X-Meshws-Node" in await response.text()  # the secret, no key
            identity = NodeIdentity.generate()
            headers = await signed_headers(client, url, SECRET, "POST", "/mesh/join", join, identity=identity)
            async with client.post(f"{url}/mesh/join", data=join, headers={**headers, **json_type}) as response:
                assert response.status == 200
            assert [node["fingerprint"] for node in right.health()["nodes"]] == [identity.fingerprint]
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            async with client.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        await right.stop()
        await tail.stop()
