"""Routes come only from a head: a middle dials a hop only when the route carries the mesh secret's MAC."""

import asyncio

import aiohttp

from fakes import FakeBackend
from meshws.config import NodeSettings
from meshws.mesh.auth import sign_route, signed_headers
from meshws.mesh.identity import NodeIdentity
from meshws.mesh.addresses import is_loopback_url
from meshws.mesh.wire import Close, Hello, Open, RouteHop, encode_control
from meshws.node import Node

SECRET = "right-secret-of-16+"


class _Middle(FakeBackend):
    start, end = 6, 9


async def _open_and_answer(ws, message: Open):
    await ws.send_str(encode_control(message))
    try:
        return await asyncio.wait_for(ws.receive_json(), 1.0)
    except asyncio.TimeoutError:
        return None  # accepted: the open travels on, nothing comes back


async def test_a_middle_dials_only_signed_routes():
    middle = Node(NodeSettings(role="middle", port=0, layers=(6, 9), secret=SECRET), backend=_Middle())
    port = await middle.start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as client:
            headers = await signed_headers(client, url, SECRET, "GET", "/ws/shard")
            async with client.ws_connect(f"ws://127.0.0.1:{port}/ws/shard", headers=headers) as ws:
                await ws.send_str(encode_control(Hello("fake-model", (0, 6), "head", "test-head", 12)))
                assert (await ws.receive_json())["type"] == "hello"
                target = (RouteHop("ws://127.0.0.1:1", (9, 12)),)
                unsigned = await _open_and_answer(ws, Open("s1", route=target))
                forged = await _open_and_answer(ws, Open("s2", route=target, route_mac=sign_route(
                    "another-secret-16+", "s2", [hop.to_wire() for hop in target])))
                replayed = await _open_and_answer(ws, Open("s3", route=target, route_mac=sign_route(
                    SECRET, "s2", [hop.to_wire() for hop in target])))  # a MAC made for another session
                for reply in (unsigned, forged, replayed):
                    assert reply["type"] == "error" and "not signed" in reply["message"], reply
                assert middle.links.all() == []  # it dialed nothing
                signed = await _open_and_answer(ws, Open("s4", route=target, route_mac=sign_route(
                    SECRET, "s4", [hop.to_wire() for hop in target])))
                assert signed is None
                assert [link.url for link in middle.links.all()] == ["ws://127.0.0.1:1"]
    finally:
        await middle.stop()


async def test_without_a_secret_routes_may_name_loopback_nodes_only():
    middle = Node(NodeSettings(role="middle", port=0, layers=(6, 9)), backend=_Middle())
    port = await middle.start()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(f"ws://127.0.0.1:{port}/ws/shard") as ws:
                await ws.send_str(encode_control(Hello("fake-model", (0, 6), "head", "test-head", 12)))
                assert (await ws.receive_json())["type"] == "hello"
                reply = await _open_and_answer(ws, Open("s1", route=(RouteHop("ws://192.0.2.7:80", (9, 12)),)))
                assert reply["type"] == "error" and "loopback" in reply["message"]
                assert middle.links.all() == []
    finally:
        await middle.stop()


def test_loopback_urls_are_parsed_not_guessed():
    assert is_loopback_url("ws://127.0.0.1:8701") and is_loopback_url("wss://[::1]:9") and is_loopback_url("ws://localhost:1")
    for url in ("ws://127.0.0.1@evil.example:80", "ws://127.evil.example:80", "ws://10.0.0.2:8701", "ws://[::1"):
        assert not is_loopback_url(url), url


async def test_dial_ins_for_invented_addresses_never_crowd_out_a_signed_route():
    """Issue 61: a member dialing in to a middle for invented URLs filled its 32 next-hop links. Now a middle takes
    a dial-in only from a node its head named, with the key that node's join proved; those have a cap of their own;
    and a route the head signed still gets its link."""
    from meshws.mesh.next_hops import MAX_DIAL_INS
    from meshws.mesh.reverse import reverse_path

    middle = Node(NodeSettings(role="middle", port=0, layers=(6, 9), secret=SECRET), backend=_Middle())
    port = await middle.start()
    url = f"http://127.0.0.1:{port}"
    member, impostor = NodeIdentity.generate(), NodeIdentity.generate()
    sockets = []

    async def dial_in(n, identity):
        path = reverse_path(f"ws://fake-{n}.invalid:1")
        headers = await signed_headers(client, url, SECRET, "GET", path, identity=identity)
        try:
            sockets.append(await client.ws_connect(f"ws://127.0.0.1:{port}{path}", headers=headers))
            return 101
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status

    try:
        async with aiohttp.ClientSession() as client:
            assert {await dial_in(n, member) for n in range(40)} == {403}  # no head named any of them
            assert await dial_in(0, None) == 401  # the secret without a node key
            middle.reverse_endpoint.expect({f"ws://fake-{n}.invalid:1": member.public_hex for n in range(40)})
            assert await dial_in(0, impostor) == 403  # a node named, another key
            statuses = [await dial_in(n, member) for n in range(40)]
            assert statuses == [101] * MAX_DIAL_INS + [403] * (40 - MAX_DIAL_INS)
            headers = await signed_headers(client, url, SECRET, "GET", "/ws/shard")
            async with client.ws_connect(f"ws://127.0.0.1:{port}/ws/shard", headers=headers) as ws:
                await ws.send_str(encode_control(Hello("fake-model", (0, 6), "head", "test-head", 12)))
                assert (await ws.receive_json())["type"] == "hello"
                target = (RouteHop("ws://127.0.0.1:1", (9, 12)),)
                signed = await _open_and_answer(ws, Open("s1", route=target, route_mac=sign_route(
                    SECRET, "s1", [hop.to_wire() for hop in target])))
                assert signed is None  # accepted: the open travels on to the real next hop's link
                assert "ws://127.0.0.1:1" in {link.url for link in middle.links.all()}
            for socket in sockets:
                await socket.close()
    finally:
        await middle.stop()


def test_every_field_of_an_open_reaches_the_tail_through_a_middle():
    """What a middle does with an `open`: parse it, pass it on with `onward` (the rest of the route, signed again),
    and the tail parses that. Every field set to a value other than its default arrives as sent, except the three
    the middle owns; a field added to `Open` must be named here, so it cannot be forgotten by the wire or a middle."""
    from dataclasses import fields, make_dataclass

    from meshws.mesh.link_pool import LinkPool
    from dataclasses import replace

    from meshws.mesh.next_hops import NextHops, signed_parts
    from meshws.mesh.wire import decode_control
    from meshws.model.text.sampling_params import SamplingParams

    tail_hop = RouteHop("ws://127.0.0.1:9/ws/shard", (9, 12), standby="ws://127.0.0.1:11")
    mine = "ws://127.0.0.1:10"  # the middle's own standby
    chosen = {"sid": "s-1", "sampling": SamplingParams(temperature=0.5, seed=7, logprobs=2), "prompt_tokens": 40,
              "route": (tail_hop,), "route_mac": sign_route(SECRET, "s-1", signed_parts((tail_hop,), mine)),
              "resume": True, "fork": ("s-0", 64), "layers": (6, 9), "kept": False, "standby": mine, "hold": True}
    assert {field.name for field in fields(Open)} == set(chosen)  # a new field: give it a value above
    assert all(chosen[field.name] != field.default for field in fields(Open) if field.name != "kept")
    assert decode_control(encode_control(Open(**{**chosen, "kept": True}))).kept  # (a kept prefix has no standby)
    middle = NextHops(_Middle(), links=LinkPool(lambda url: None), static_peer=None, secret=SECRET, open_routes=False)
    received = decode_control(encode_control(Open(**chosen)))
    assert received == Open(**chosen)
    url, rest = middle.choose(received)
    assert middle.standby(received) == mine  # signed by the head
    at_tail = decode_control(encode_control(middle.onward(received, rest)))
    assert url == tail_hop.url and at_tail.route == () and at_tail.layers == (9, 12)
    assert at_tail.standby == tail_hop.standby and NextHops(_Middle(), LinkPool(lambda url: None), None, SECRET,
                                                            False).standby(at_tail) == tail_hop.standby  # signed anew
    assert at_tail.hold  # this middle has a standby: if its link drops, the tail keeps the session a while
    owned = ("route", "route_mac", "layers", "standby", "hold")  # what the middle sets for the next hop
    assert {name: getattr(at_tail, name) for name in chosen if name not in owned} == \
        {name: value for name, value in chosen.items() if name not in owned}
    forged = replace(received, standby="ws://10.9.9.9:1")
    assert middle.standby(forged) is None  # a standby the head did not sign is not fed
    wider = make_dataclass("WiderOpen", [("added", str, "")], bases=(Open,), frozen=True)
    assert middle.onward(wider(**chosen, added="x"), rest).added == "x"  # not rebuilt by position


async def test_a_node_refuses_standby_rows_it_cannot_or_may_not_keep():
    """kv frames over a link: a bad one and one for a node that keeps no copies (a fake backend) are refused in an
    error frame naming the session; a standby's kv_ack sent to a shard, and a close of a copy it never had, change
    nothing; the link and the node go on (the next open is answered as ever)."""
    from meshws.mesh.wire import KVAck, encode_kv

    class _Tail(FakeBackend):
        start, end, is_tail = 9, 12, True

    tail = Node(NodeSettings(role="tail", port=0, layers=(9, 12), secret=SECRET), backend=_Tail())
    port = await tail.start()
    try:
        async with aiohttp.ClientSession() as client:
            headers = await signed_headers(client, f"http://127.0.0.1:{port}", SECRET, "GET", "/ws/shard")
            async with client.ws_connect(f"ws://127.0.0.1:{port}/ws/shard", headers=headers) as ws:
                await ws.send_str(encode_control(Hello("fake-model", (6, 9), "middle", "test-middle", 12)))
                assert (await ws.receive_json())["type"] == "hello"
                await ws.send_bytes(encode_kv("s1", 0, "bfloat16", (3, 2, 1, 4, 8), bytes(10), 1 << 20))
                bad = await ws.receive_json(timeout=5)
                assert bad["sid"] == "s1" and "bad standby frame" in bad["message"], bad
                await ws.send_bytes(encode_kv("s2", 0, "bfloat16", (3, 2, 1, 4, 8), bytes(384), 1 << 20))
                refused = await ws.receive_json(timeout=5)
                assert refused["sid"] == "s2" and "keeps no copies" in refused["message"], refused
                await ws.send_str(encode_control(KVAck(sid="s2", length=9)))
                assert "does not accept 'kv_ack'" in (await ws.receive_json(timeout=5))["message"]
                await ws.send_str(encode_control(Close(sid="s3", grace=True)))
                assert await _open_and_answer(ws, Open("s4", layers=(9, 12))) is None  # accepted: nothing comes back
                assert tail.health()["standbys"] == 0 and tail.health()["channels"] == 1
    finally:
        await tail.stop()
