"""Each node's own key (issue 61): a member cannot join, leave, dial in or relay in another live member's name.

The head and the middle are real nodes in this process (fake models); the members are this test, each with a key
of its own, signing as a node does (`signed_headers`)."""

import asyncio
import os
import stat

import aiohttp
import pytest

from fakes import CachedHeadBackend, FakeBackend
from helpers import serving
from meshws.access import NodeAccess
from meshws.config import NodeSettings, check_settings
from meshws.mesh import identity
from meshws.mesh.auth import body_digest, signed_headers
from meshws.mesh.identity import NodeIdentity, read_fingerprints, verify
from meshws.mesh.reverse import relay_path, reverse_path
from meshws.node import Node

SECRET = "right-secret-of-16+"
TAIL, MIDDLE = "ws://tail.invalid:1", "ws://middle.invalid:2"  # (no such hosts: the head cannot dial them)


def test_a_key_is_made_once_readable_by_its_user_only_and_kept(tmp_path):
    first = NodeIdentity.load_or_create(tmp_path / "cache")
    path = tmp_path / "cache" / identity.KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = NodeIdentity.load_or_create(tmp_path / "cache")
    assert again.public_hex == first.public_hex and len(first.fingerprint) == 32
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [identity.KEY_FILE]  # no temporary left
    path.write_text("not a key\n")
    with pytest.raises(ValueError, match="does not hold a node key"):
        NodeIdentity.load_or_create(tmp_path / "cache")
    with pytest.raises(SystemExit, match="this node's key cannot be used: .* does not hold a node key"):
        NodeAccess(NodeSettings(role="head", layers=(0, 6), secret=SECRET, cache_dir=str(tmp_path / "cache")))
    path.unlink()
    (tmp_path / "elsewhere").write_text("0" * 64)
    path.symlink_to(tmp_path / "elsewhere")  # a key file is never read (nor written) through a link
    with pytest.raises(OSError):
        NodeIdentity.load_or_create(tmp_path / "cache")


def test_a_header_proves_the_key_for_that_one_request_to_that_one_node_only():
    me, other, head, middle = (NodeIdentity.generate() for _ in range(4))
    digest = body_digest(b'{"url": "x"}')
    header = me.header("n1", "POST", "/mesh/join", digest, head.public_hex)
    assert verify(header, "n1", "POST", "/mesh/join", digest, head.public_hex) == (me.public_hex, "")
    for changed in [("n2", "POST", "/mesh/join", digest), ("n1", "GET", "/mesh/join", digest),
                    ("n1", "POST", "/mesh/leave", digest), ("n1", "POST", "/mesh/join", body_digest(b"{}"))]:
        assert verify(header, *changed, head.public_hex)[0] is None
    # Made for the middle's challenge, even with a nonce of the head's, it does not hold at the head.
    for_middle = me.header("n1", "POST", "/mesh/join", digest, middle.public_hex)
    assert "to this node" in verify(for_middle, "n1", "POST", "/mesh/join", digest, head.public_hex)[1]
    swapped = other.public_hex + header[64:]  # another's key beside my signature
    assert "does not hold" in verify(swapped, "n1", "POST", "/mesh/join", digest, head.public_hex)[1]
    for bad in [None, "", "x" * 300, header[:-2], header.upper(), header.replace(".", ":")]:
        assert verify(bad, "n1", "POST", "/mesh/join", digest, head.public_hex)[0] is None


@pytest.mark.parametrize("point", [
    "01" + "00" * 31,  # the identity: (0, 1)
    "ec" + "ff" * 30 + "7f",  # (0, -1), of order 2
    "00" * 32, "00" * 31 + "80",  # of order 4
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # of order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "ee" + "ff" * 30 + "7f",  # y = p + 1: not canonical
])
def test_a_key_of_small_order_proves_nothing(point):
    # The identity's signature (R = identity, S = 0) holds for every message under some verifiers.
    forged = f"{point}.{'01' + '00' * 63}"
    assert identity.small_order(point)
    assert "small order" in verify(forged, "n1", "GET", "/mesh/reverse/x", body_digest(b""), "ab" * 32)[1]
    assert not identity.small_order(NodeIdentity.generate().public_hex)


def test_a_fingerprint_file_is_read_strictly(tmp_path):
    me = NodeIdentity.generate()
    listed = tmp_path / "trusted"
    listed.write_text(f"# the tail\n{me.fingerprint.upper()}  # desk\n\n")
    assert read_fingerprints(str(listed)) == {me.fingerprint}
    listed.write_text("abc\n")
    with pytest.raises(ValueError, match="trusted:1: not a node fingerprint"):
        read_fingerprints(str(listed))
    settings = NodeSettings(role="head", layers=(0, 6), secret=SECRET, trusted_nodes=str(listed))
    assert "not a node fingerprint" in check_settings(settings)
    listed.write_text("# nobody\n")
    assert "names no fingerprint" in check_settings(settings)
    assert "with a mesh secret" in check_settings(NodeSettings(role="head", layers=(0, 6), trusted_nodes=str(listed)))


class Member:
    """One member of the mesh: the secret, and a key of its own."""

    def __init__(self, client, head_url):
        self.client, self.head, self.key = client, head_url, NodeIdentity.generate()

    async def post(self, path, data):
        body = __import__("orjson").dumps(data)
        headers = await signed_headers(self.client, self.head, SECRET, "POST", path, body, identity=self.key)
        async with self.client.post(self.head + path, data=body,
                                    headers={**headers, "Content-Type": "application/json"}) as response:
            return response.status, await response.json()

    async def join(self, url, layers):
        return await self.post("/mesh/join", {"url": url, "node": url, "model": "fake-model", "layers": layers,
                                              "role": "middle" if layers[1] < 12 else "tail"})

    async def dial(self, base, path):
        """The status a signed websocket dial of `path` gets (101: taken)."""
        headers = await signed_headers(self.client, base, SECRET, "GET", path, identity=self.key)
        try:
            ws = await self.client.ws_connect(base.replace("http", "ws") + path, headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status
        await ws.close()
        return 101


@pytest.fixture
async def head():
    node = Node(NodeSettings(role="head", port=0, layers=(0, 6), secret=SECRET), backend=CachedHeadBackend())
    port = await node.start()
    async with aiohttp.ClientSession() as client:
        yield node, client, f"http://127.0.0.1:{port}"
    await node.stop()


async def _undialable(node, url):
    """Until the head has failed to dial `url` (the node there dials in instead)."""
    for _ in range(200):
        if url in node.links and node.links.get(url).dial_failures:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the head never tried {url}")


async def test_a_live_registration_is_not_taken_over(head):
    node, client, url = head
    tail, impostor = Member(client, url), Member(client, url)
    assert (await tail.join(TAIL, [6, 12]))[0] == 200
    status, answer = await impostor.join(TAIL, [6, 12])
    assert status == 409 and "another node key" in answer["error"]
    assert (await impostor.post("/mesh/leave", {"url": TAIL}))[0] == 403
    assert [(n["url"], n["fingerprint"]) for n in node.health()["nodes"]] == [(TAIL, tail.key.fingerprint)]
    await _undialable(node, TAIL)
    assert await impostor.dial(url, reverse_path(TAIL)) == 403  # its socket would carry the tail's sessions
    assert await tail.dial(url, reverse_path(TAIL)) == 101
    assert (await tail.join(TAIL, [6, 12]))[0] == 200  # its heartbeat, with its key, goes on
    assert (await tail.post("/mesh/leave", {"url": TAIL + "/"}))[0] == 200  # (its URL as it was written)
    assert (await impostor.join(TAIL, [6, 12]))[0] == 200  # gone: the address is free to bind again


async def test_a_silent_members_url_is_not_taken_within_the_grace(head):
    node, client, url = head
    tail, impostor = Member(client, url), Member(client, url)
    assert (await tail.join(TAIL, [6, 12]))[0] == 200
    record = node.registry._nodes[TAIL]
    record.last_seen -= node.registry.ttl + 1  # its heartbeats stopped (a restart, a blink of its network)
    assert node.registry.nodes() == []
    status, answer = await impostor.join(TAIL, [6, 12])
    assert status == 409 and "stops answering" in answer["error"]
    assert (await impostor.post("/mesh/leave", {"url": TAIL}))[0] == 403
    assert (await tail.join(TAIL, [6, 12]))[0] == 200  # the node itself comes back


async def test_nobody_joins_with_the_heads_own_peer_url(tmp_path):
    peer = "ws://127.0.0.1:9"  # (nothing listens: the head's static link stays down)
    node = Node(NodeSettings(role="head", port=0, layers=(0, 6), secret=SECRET, peer=peer + "/"),
                backend=CachedHeadBackend())
    port = await node.start()
    try:
        async with aiohttp.ClientSession() as client:
            status, answer = await Member(client, f"http://127.0.0.1:{port}").join(peer, [6, 12])
            assert status == 409 and "--peer" in answer["error"] and node.registry.nodes() == []
    finally:
        await node.stop()


async def test_relay_sockets_prove_the_key_of_the_node_they_stand_for(head):
    node, client, url = head
    middle, tail, impostor = Member(client, url), Member(client, url), Member(client, url)
    assert (await middle.join(MIDDLE, [6, 9]))[0] == 200
    assert (await tail.join(TAIL, [9, 12]))[0] == 200
    await _undialable(node, TAIL)
    await _undialable(node, MIDDLE)
    back, pipe = reverse_path(TAIL, MIDDLE), relay_path(TAIL, MIDDLE)
    assert await impostor.dial(url, back) == 403 and await middle.dial(url, back) == 403  # the tail's to open
    assert await impostor.dial(url, pipe) == 403 and await tail.dial(url, pipe) == 403  # the middle's
    assert await tail.dial(url, back) == 101  # (waits for a middle: closed here)
    status, _ = await middle.post("/mesh/leave", {"url": TAIL})
    assert status == 403


async def test_one_member_key_has_caps_of_its_own(head, monkeypatch):
    from meshws.head import membership
    from meshws.mesh import reverse

    node, client, url = head
    monkeypatch.setattr(membership, "URLS_PER_KEY", 2)
    monkeypatch.setattr(reverse, "RELAYS_PER_MEMBER", 1)
    middle, tail, other = Member(client, url), Member(client, url), Member(client, url)
    assert (await middle.join(MIDDLE, [6, 9]))[0] == 200
    assert (await tail.join(TAIL, [9, 12]))[0] == 200
    assert (await tail.join("ws://tail-2.invalid:1", [9, 12]))[0] == 200
    status, answer = await tail.join("ws://tail-3.invalid:1", [9, 12])
    assert status == 429 and "2 addresses" in answer["error"]
    assert (await other.join("ws://tail-3.invalid:1", [9, 12]))[0] == 200  # another member's key: its own count
    await _undialable(node, TAIL)
    await _undialable(node, MIDDLE)
    headers = await signed_headers(client, url, SECRET, "GET", reverse_path(TAIL, MIDDLE), identity=tail.key)
    held = await client.ws_connect(url.replace("http", "ws") + reverse_path(TAIL, MIDDLE), headers=headers)
    assert await tail.dial(url, reverse_path(TAIL, MIDDLE)) == 503  # its one relay socket waits already
    await held.close()


async def test_a_head_with_trusted_nodes_lets_only_those_keys_join(tmp_path):
    listed = tmp_path / "trusted"
    trusted = NodeIdentity.generate()
    listed.write_text(trusted.fingerprint + "\n")
    node = Node(NodeSettings(role="head", port=0, layers=(0, 6), secret=SECRET, trusted_nodes=str(listed)),
                backend=CachedHeadBackend())
    port = await node.start()
    try:
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{port}"
            stranger, member = Member(client, url), Member(client, url)
            member.key = trusted
            status, answer = await stranger.join(TAIL, [6, 12])
            assert status == 401 and "not among this head's --trusted-nodes" in answer["error"]
            assert (await member.join(TAIL, [6, 12]))[0] == 200
    finally:
        await node.stop()


class _Middle(FakeBackend):
    start, end = 6, 9


async def test_a_middle_takes_dial_ins_only_from_the_nodes_and_keys_its_head_names(head):
    """A real middle joins the head; a tail nobody can dial joins after it: the middle's next heartbeat answer
    names that tail and its key, and the middle takes that tail's socket, no other's."""
    node, client, url = head
    middle = Node(NodeSettings(role="middle", port=0, layers=(6, 9), secret=SECRET, join=url), backend=_Middle())
    port = await middle.start()
    try:
        tail, impostor = Member(client, url), Member(client, url)
        base = f"http://127.0.0.1:{port}"
        assert await tail.dial(base, reverse_path(TAIL)) == 403  # nobody named it yet
        assert (await tail.join(TAIL, [9, 12]))[0] == 200
        await _undialable(node, TAIL)
        status, answer = await tail.join(TAIL, [9, 12])
        assert answer["dial_in"] == [middle.advertise]  # the head tells the tail to dial the middle
        for _ in range(100):  # ... and the middle, on its next heartbeat, to expect it
            if middle.reverse_endpoint.expected:
                break
            await asyncio.sleep(0.1)
        assert middle.reverse_endpoint.expected == {TAIL: tail.key.public_hex}
        assert await impostor.dial(base, reverse_path(TAIL)) == 403
        assert await tail.dial(base, reverse_path(TAIL)) == 101
    finally:
        await middle.stop()


async def test_a_signature_a_middle_asked_for_with_the_heads_nonce_does_not_open_the_head(head):
    """A member posing as the middle a tail dials in to answers the tail's challenge with a nonce of the head's, to
    replay the tail's signed dial-in at the head. Naming its own key, the signature it gets is for it alone; naming
    the head's, the tail does not sign (its head named the middle's key)."""
    from aiohttp import web

    from meshws.mesh.auth import HEADER, listener_proof

    node, client, url = head
    tail, middle = Member(client, url), Member(client, url)
    assert (await tail.join(TAIL, [6, 12]))[0] == 200
    await _undialable(node, TAIL)
    path = reverse_path(TAIL)
    named = {"key": middle.key.public_hex}  # the key the false middle's challenge names
    captured = {}

    async def challenge(request):
        async with client.get(url + "/mesh/challenge") as response:
            nonce = (await response.json())["nonce"]
        return web.json_response({"nonce": nonce, "node": named["key"],
                                  "proof": listener_proof(SECRET, request.query["proof_for"], nonce)})

    async def dial_in(request):
        captured.update({name: request.headers[name] for name in (HEADER, identity.HEADER)})
        raise web.HTTPForbidden()

    app = web.Application()
    app.router.add_get("/mesh/challenge", challenge)
    app.router.add_get("/mesh/reverse/{url}", dial_in)
    async with serving(app) as false_middle:
        headers = await signed_headers(client, false_middle, SECRET, "GET", path, identity=tail.key,
                                       peer_key=middle.key.public_hex)
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await client.ws_connect(false_middle.replace("http", "ws") + path, headers=headers)
        assert captured
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:  # replayed at the head
            await client.ws_connect(url.replace("http", "ws") + path, headers=captured)
        assert refused.value.status == 401  # (its signature is for the false middle)
        async with client.get(url + "/mesh/challenge") as response:
            named["key"] = (await response.json())["node"]  # now it names the head's key
        with pytest.raises(ConnectionError, match="another key than its head named"):
            await signed_headers(client, false_middle, SECRET, "GET", path, identity=tail.key,
                                 peer_key=middle.key.public_hex)
        named["key"] = ""  # naming no key, to a node its heads named none for (or disputed)
        with pytest.raises(ConnectionError, match="another key than its head named"):
            await signed_headers(client, false_middle, SECRET, "GET", path, identity=tail.key, peer_key="")
        assert await tail.dial(url, path) == 101  # the tail itself still dials in


def test_keys_two_heads_name_differently_are_refused_and_a_silent_heads_are_forgotten():
    from meshws.mesh.membership import Announcer

    told = []
    announcer = Announcer("http://h1.invalid:1,http://h2.invalid:2", record=dict, expect=told.append)
    first, second = "a" * 64, "b" * 64
    announcer._heard("http://h1.invalid:1", {"dial_ins": [{"url": TAIL, "key": first}]})
    assert told[-1] == {TAIL: first}
    announcer._heard("http://h2.invalid:2", {"dial_ins": [{"url": TAIL, "key": first}]})
    assert told[-1] == {TAIL: first}  # (both agree)
    announcer._heard("http://h2.invalid:2", {"dial_ins": [{"url": TAIL, "key": second}]})
    assert told[-1] == {}  # which is it? neither
    announcer._forget("http://h2.invalid:2")  # that head stopped answering: what it named goes
    assert told[-1] == {TAIL: first}
    announcer._forget("http://h1.invalid:1")
    assert told[-1] == {}
