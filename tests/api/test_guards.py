"""No cross-site reach: Host and Origin checks, JSON-only bodies, CORS, security headers, no leaked addresses."""

import aiohttp
import pytest

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh
from meshws.api.errors import public_text
from meshws.api.guards import RequestGuard

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_hosts_that_may_address_the_page_and_the_api():
    guard = RequestGuard(["0.0.0.0", "box1", "10.0.0.1"], allowed_hosts=["chat.example.org"])
    for host in ("127.0.0.1:8700", "[::1]:8700", "localhost:8700", "10.9.8.7", "box1:8700", "chat.example.org",
                 "CHAT.example.org:443", "app.localhost"):
        assert guard.host_allowed(host), host
    for host in ("evil.example", "rebind.attacker.test:8700", "", None, "box1.attacker.test"):
        assert not guard.host_allowed(host), host


def test_origins_that_may_call_the_api():
    guard = RequestGuard([], cors_origins=["https://app.example"])
    assert guard.origin_allowed(None, "127.0.0.1:8700")  # not a browser
    assert guard.origin_allowed("http://127.0.0.1:8700", "127.0.0.1:8700")  # the page itself
    assert guard.origin_allowed("https://app.example/", "127.0.0.1:8700")
    assert not guard.origin_allowed("https://evil.example", "127.0.0.1:8700")
    assert not guard.origin_allowed("null", "127.0.0.1:8700")
    assert not guard.origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8700")


def test_error_texts_for_clients_name_no_internal_address():
    text = ("tail@10.0.0.2:8701: next hop unreachable: link to ws://10.0.0.3:8702 is down "
            "(ConnectionRefusedError: [Errno 111] Connect call failed ('10.0.0.3', 8702)); next hop wss://[fd00::1]:9")
    public = public_text(text)
    assert "10.0.0" not in public and "ws://" not in public and "fd00" not in public
    assert public.startswith("tail: next hop unreachable")


async def test_cross_site_requests_are_refused_and_same_site_ones_answered():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend(), cors_origins=("https://app.example",)) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        async with aiohttp.ClientSession() as client:
            join = {"url": "ws://127.0.0.1:1", "model": "fake-model", "layers": [6, 12]}
            async with client.post(f"{url}/mesh/join", json=join, headers={"Origin": "https://evil.example"}) as r:
                assert r.status == 403
            async with client.post(f"{url}/mesh/join", data=b"{}", headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415
            async with client.get(f"http://127.0.0.1:{mesh.tail_port}/ws/shard",
                                  headers={"Origin": "http://127.0.0.1"}) as r:
                assert r.status == 403
            async with client.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"Origin": "https://evil.example"}) as r:
                assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
            async with client.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": url}) as r:
                assert r.status == 200
            async with client.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"Host": "rebind.attacker.test:8700"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "host_not_allowed"
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect(f"{url}/ws/chat", headers={"Origin": "https://evil.example"})
            assert refused.value.status == 403
            async with client.ws_connect(f"{url}/ws/chat", headers={"Origin": url}) as ws:
                await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "hi"}]})
                assert (await ws.receive_json())["type"] == "start"


async def test_cors_preflight_and_security_headers():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend(), cors_origins=("https://app.example",)) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        async with aiohttp.ClientSession() as client:
            async with client.options(f"{url}/v1/chat/completions", headers=preflight) as r:
                assert r.status == 204
                assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert "POST" in r.headers["Access-Control-Allow-Methods"]
                assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
            async with client.options(f"{url}/v1/chat/completions",
                                      headers={**preflight, "Origin": "https://evil.example"}) as r:
                assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
            async with client.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"Origin": "https://app.example"}) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            async with client.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True},
                                   headers={"Origin": "https://app.example"}) as r:  # a stream, prepared early
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            async with client.options(f"{url}/tokenize", headers=preflight) as r:  # the tokenizer is the API's too
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            async with client.post(f"{url}/tokenize", json={"prompt": "hi"},
                                   headers={"Origin": "https://evil.example"}) as r:
                assert r.status == 403
            async with client.get(f"{url}/") as r:
                assert r.status == 200
                csp = r.headers["Content-Security-Policy"]
                assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
                assert r.headers["X-Content-Type-Options"] == "nosniff"
