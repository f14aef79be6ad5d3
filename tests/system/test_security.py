"""Secure by default across machines, tried as an attacker would, with real node processes.

Strangers cannot join or link, a captured header opens nothing elsewhere, a node will not
listen beyond loopback without a secret, links and the API run over TLS with a CA made
here, and a client on another host (a network namespace) sees only the public face.
"""

import asyncio
import ssl
import subprocess
import sys

import aiohttp
import openai
import orjson
import pytest

import helpers
from helpers import EXACT, MODEL, SECRET, chat_ids, golden
from meshws.mesh.auth import HEADER, sign, signed_headers
from meshws.mesh.wire import Hello, encode_control
from meshws.tools.launch import Mesh, NodeProcess, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

def _node_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshws.node", *args], capture_output=True, text=True, timeout=60)


def test_listening_beyond_loopback_needs_a_secret_or_insecure(embedded_model):
    port = str(free_port())
    refused = _node_cli("--role", "tail", "--layers", "15-29", "--host", "0.0.0.0", "--port", port)
    assert refused.returncode != 0
    assert "--secret" in refused.stderr and "--insecure" in refused.stderr
    short = _node_cli("--role", "tail", "--layers", "15-29", "--secret", "short")
    assert short.returncode != 0 and "at least 16 bytes" in short.stderr
    node = NodeProcess("--role", "tail", "--layers", "15-29", "--host", "0.0.0.0", "--insecure", name="insecure")
    try:
        node.wait_started()
        assert any("INSECURE" in line for line in node.lines)
    finally:
        assert node.stop() == 0


async def test_strangers_cannot_join_and_a_header_for_one_node_opens_nothing_on_another(secret_file):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=("--secret-file", secret_file))
    other = NodeProcess("--role", "tail", "--layers", "15-29", "--secret-file", secret_file, name="other tail")
    try:
        other.wait_started()
        stranger = {"url": "ws://127.0.0.1:9", "node": "evil", "model": MODEL, "layers": [15, 30], "load": 0}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/mesh/join", json=stranger) as response:
                assert response.status == 401
            with pytest.raises(ConnectionError, match="cannot prove"):  # nor will a stranger mistake it for a peer
                await signed_headers(client, mesh.head.url, "a-guessed-secret-00000", "POST", "/mesh/join", b"{}")
            nonce = (await (await client.get(f"{mesh.head.url}/mesh/challenge")).json())["nonce"]
            body = orjson.dumps(stranger)
            forged = {HEADER: sign("a-guessed-secret-00000", nonce, "POST", "/mesh/join", body),
                      "Content-Type": "application/json"}
            async with client.post(f"{mesh.head.url}/mesh/join", data=body, headers=forged) as response:
                assert response.status == 401
            health = mesh.head.health()
            assert all(node["url"] != "ws://127.0.0.1:9" for node in health["nodes"])
            assert [hop["node"] for hop in health["chain"]][-1].startswith("tail@")
            # A header made for the tail, shown to another node with the same secret, opens nothing there.
            captured = await signed_headers(client, mesh.tail.url, SECRET, "GET", "/ws/shard")
            async with client.get(f"{other.url}/ws/shard", headers=captured) as response:
                assert response.status == 401
                assert "did not hand out" in await response.text()
            async with client.ws_connect(f"{mesh.tail.ws_url}/ws/shard", headers=captured) as ws:
                await ws.send_str(encode_control(Hello(MODEL, (0, 15), "head", "test", 30)))
                assert (await ws.receive_json())["type"] == "hello"
            async with client.get(f"{mesh.tail.url}/ws/shard", headers=captured) as response:
                assert response.status == 401  # and it works only once
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        other.stop()
        mesh.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A certificate authority made here, and a certificate it signed for the loopback names."""
    import trustme

    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": folder / "ca.pem", "cert": folder / "node.pem", "key": folder / "node.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return {name: str(path) for name, path in paths.items()}


async def test_a_mesh_over_tls_gives_the_golden_answer_and_refuses_an_unverified_peer(pki, tokenizer,
                                                                                        reference_model):
    tls = ("--tls-cert", pki["cert"], "--tls-key", pki["key"])
    tail = NodeProcess("--role", "tail", "--layers", "15-29", *EXACT, *tls, name="tls tail", ca=pki["ca"])
    head = blind = None
    try:
        tail.wait_started()
        head = NodeProcess("--role", "head", "--layers", "0-14", *EXACT, *tls, "--tls-ca", pki["ca"],
                           "--peer", tail.ws_url, name="tls head", ca=pki["ca"]).wait_started()
        head.wait_ready()
        ids = chat_ids(tokenizer, "Explain in detail how a bicycle works.")
        context = ssl.create_default_context(cafile=pki["ca"])
        async with aiohttp.ClientSession() as client:
            body = {"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            async with client.post(f"{head.url}/v1/completions", json=body, ssl=context) as response:
                assert response.status == 200
                tokens = (await response.json())["choices"][0]["token_ids"]
        assert tokens == golden(reference_model, ids, 16)
        api = openai.OpenAI(base_url=f"{head.url}/v1", api_key="unused",
                            http_client=openai.DefaultHttpxClient(verify=context))
        answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=6, temperature=0)
        assert answer.choices[0].message.content
        # The same head without the mesh's CA cannot link to the tail, and says why.
        blind = NodeProcess("--role", "head", "--layers", "0-14", "--peer", tail.ws_url, name="blind head")
        blind.wait_started()
        await asyncio.sleep(2.0)
        assert not blind.health()["ready"]
        assert any("certificate does not verify" in line for line in blind.lines), blind.lines[-10:]
    finally:
        for node in (blind, head, tail):
            if node is not None:
                node.stop()


@pytest.fixture(scope="module")
def other_host():
    """Another host on this machine: a network namespace joined to this one by a veth pair."""
    with helpers.other_host("10.231.7.1", "10.231.7.2") as name:
        yield {"namespace": name, "host_ip": "10.231.7.1"}


def _fetch_from(host, url, headers=None, data=None):
    """GET `url` from the other host (POST `data`, if given); (status, body)."""
    script = ("import sys, urllib.request, urllib.error, json\n"
              "data = sys.argv[3].encode() if len(sys.argv) > 3 else None\n"
              "request = urllib.request.Request(sys.argv[1], headers=json.loads(sys.argv[2]), data=data)\n"
              "try:\n    r = urllib.request.urlopen(request, timeout=10); print(r.status); print(r.read().decode())\n"
              "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n")
    import json

    done = subprocess.run(["ip", "netns", "exec", host["namespace"], sys.executable, "-c", script, url,
                           json.dumps(headers or {}), *([data] if data is not None else [])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    status, _, body = done.stdout.partition("\n")
    return int(status), body


def test_from_another_host_the_public_face_leaks_nothing(secret_file, other_host):
    port = free_port()
    host = other_host["host_ip"]
    tail = NodeProcess("--role", "tail", "--layers", "15-29", "--secret-file", secret_file, name="tail")
    head = None
    try:
        tail.wait_started()  # the head dials the tail on loopback; users come from the other host
        head = NodeProcess("--role", "head", "--layers", "0-14", "--host", host, "--secret-file", secret_file,
                           "--api-key", "test-api-key", "--peer", tail.ws_url, name="head", port=port)
        head.wait_started()
        url = f"http://{host}:{port}"
        status, body = _fetch_from(other_host, f"{url}/health")
        assert status == 200 and "ws://" not in body and "127.0.0.1" not in body and host not in body
        assert '"role":"head"' in body.replace(" ", "") and '"links"' not in body
        status, body = _fetch_from(other_host, f"{url}/health", {"Authorization": "Bearer test-api-key"})
        assert status == 200 and tail.ws_url in body and '"links"' in body
        status, body = _fetch_from(other_host, f"{url}/")
        assert status == 200 and "meshws chat" in body
        status, body = _fetch_from(other_host, f"{url}/", {"Host": "rebind.attacker.test"})
        assert status == 400
        status, _ = _fetch_from(other_host, f"{url}/mesh/join", {"Content-Type": "application/json"},
                                data='{"url": "ws://10.231.7.2:1"}')
        assert status == 401
    finally:
        if head is not None:
            head.stop()
        tail.stop()
