"""Nodes nobody can dial (behind NAT): a tail in a network namespace that drops every inbound SYN joins a head and
serves through a middle, its links dialed the other way (mesh/reverse.py), and comes back after a SIGKILL; a middle
and a tail both behind NAT are relayed by the head (mesh/relay.py), within its caps."""

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import EXACT, SECRET, chat_ids, complete_ids, golden, other_host
from meshws.tools.launch import NodeProcess, free_port
from meshws.tools.namespaces import DROP_INBOUND

pytestmark = [pytest.mark.real_model, pytest.mark.processes,
              pytest.mark.skipif(not shutil.which("iptables") or not shutil.which("ip"),
                                 reason="needs ip and iptables (Debian: iptables), and root")]

HOST_IP, NAT_IP = "10.231.9.1", "10.231.9.2"


@pytest.fixture(scope="module")
def behind_nat():
    """A host behind NAT: a network namespace joined to this one by a veth pair, which may dial out but drops
    every connection dialed to it (inbound SYNs)."""
    try:
        with other_host(HOST_IP, NAT_IP, DROP_INBOUND) as name:
            yield name
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a namespace behind NAT here: {' '.join(exc.cmd)}: {exc.stderr}")


def health_inside(namespace, url):
    """A node's /health, asked on loopback inside its namespace (nothing outside can reach it)."""
    script = ("import sys, urllib.request, urllib.error\n"
              "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())\n"
              "except urllib.error.HTTPError as e:\n    print(e.read().decode())\n")
    done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", script, url + "/health"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def links_to(node, url):
    return [link for link in node.health()["links"] if link["url"] == url]


def test_a_tail_nobody_can_dial_dials_in_serves_the_golden_answer_and_comes_back_after_a_kill(
        secret_file, behind_nat, reference_model, tokenizer):
    secret = ("--secret-file", secret_file)
    # The head and the middle listen everywhere: the test reads their detailed /health on loopback, the tail
    # reaches them on the veth's address.
    head_port, middle_port = free_port(), free_port()
    head = NodeProcess("--role", "head", "--layers", "0-9", "--host", "0.0.0.0", *secret, *EXACT, name="head",
                       port=head_port)
    head.wait_started()
    join = ("--join", f"http://{HOST_IP}:{head_port}")
    middle = NodeProcess("--role", "middle", "--layers", "10-19", "--host", "0.0.0.0", "--advertise",
                         f"ws://{HOST_IP}:{middle_port}", *secret, *join, *EXACT, name="middle", port=middle_port)
    tail_port = free_port()
    tail = None

    def start_tail():
        return NodeProcess("--role", "tail", "--layers", "20-29", "--host", "0.0.0.0", "--advertise",
                           f"ws://{NAT_IP}:{tail_port}", *secret, *join, *EXACT, name="nat tail", host=NAT_IP,
                           port=tail_port, netns=behind_nat).wait_started()

    try:
        middle.wait_started()
        tail = start_tail()
        with pytest.raises(OSError):  # nobody outside can reach it: that is the point
            tail.health()
        head.wait_ready(timeout=60)
        [head_link] = links_to(head, tail.ws_url)
        assert head_link["state"] == "up" and head_link["formed"].startswith("reversed")
        head_url, middle_url = f"http://{HOST_IP}:{head_port}", f"http://{HOST_IP}:{middle_port}"
        deadline = time.monotonic() + 30  # (the head is ready once its own link is up; the middle's may come after)
        while True:
            dialing = {entry["to"]: entry
                       for entry in health_inside(behind_nat, f"http://127.0.0.1:{tail_port}")["dialing_in"]}
            if set(dialing) == {head_url, middle_url} and all(entry["state"] == "up" for entry in dialing.values()):
                break
            assert time.monotonic() < deadline, dialing
            time.sleep(0.2)

        ids = chat_ids(tokenizer, "What is the capital of France?")
        expected = golden(reference_model, ids, 24)
        tokens, _ = asyncio.run(complete_ids(head.url, ids, 24))
        assert tokens == expected
        [middle_link] = links_to(middle, tail.ws_url)  # the route went head -> middle -> tail, dialed by the tail
        assert middle_link["formed"].startswith("reversed") and middle_link["connects"] >= 1

        tail.kill()
        started = time.monotonic()
        tail = start_tail()
        while True:  # the head may first hear the old socket go, then the new one dial in
            try:
                tokens, _ = asyncio.run(complete_ids(head.url, ids, 24))
                break
            except AssertionError:
                assert time.monotonic() - started < 30, head.health()
                time.sleep(0.5)
        assert tokens == expected and time.monotonic() - started < 30
        assert links_to(head, tail.ws_url)[0]["connects"] >= 2
    finally:
        for node in (tail, middle, head):
            if node is not None:
                node.stop()


MIDDLE_HOST_IP, MIDDLE_NAT_IP = "10.231.10.1", "10.231.10.2"


@pytest.fixture(scope="module")
def middle_behind_nat():
    """A second host behind NAT, with no way to the first but through this one's head."""
    with other_host(MIDDLE_HOST_IP, MIDDLE_NAT_IP, DROP_INBOUND) as name:
        yield name


def _key(own=True):
    """The node key of this host's nodes (they share the cache folder, hence one key), or a key of another member."""
    from meshws.mesh.identity import NodeIdentity
    from meshws.model.gguf.model_files import default_cache_dir

    return NodeIdentity.load_or_create(default_cache_dir()) if own else NodeIdentity.generate()


async def _refused(url, path, own=True):
    """The status a signed GET of `path` on the node at `url` gets (a relay that is not allowed: 403), signed with
    the nodes' own key or another member's."""
    import aiohttp

    from meshws.mesh.auth import signed_headers

    async with aiohttp.ClientSession() as client:
        headers = await signed_headers(client, url, SECRET, "GET", path, identity=_key(own))
        async with client.get(url + path, headers=headers) as response:
            return response.status


def test_a_middle_and_a_tail_both_behind_nat_are_relayed_by_the_head_within_its_caps(
        secret_file, behind_nat, middle_behind_nat, reference_model, tokenizer):
    from meshws.mesh.relay import WAITING
    from meshws.mesh.reverse import relay_path, reverse_path

    secret = ("--secret-file", secret_file)
    head_port, middle_port, tail_port = free_port(), free_port(), free_port()
    head = NodeProcess("--role", "head", "--layers", "0-9", "--host", "0.0.0.0", *secret, *EXACT, name="head",
                       port=head_port)
    middle = tail = None
    try:
        head.wait_started()
        middle = NodeProcess("--role", "middle", "--layers", "10-19", "--host", "0.0.0.0", "--advertise",
                             f"ws://{MIDDLE_NAT_IP}:{middle_port}", *secret, "--join",
                             f"http://{MIDDLE_HOST_IP}:{head_port}", *EXACT, name="nat middle", host=MIDDLE_NAT_IP,
                             port=middle_port, netns=middle_behind_nat).wait_started()
        tail = NodeProcess("--role", "tail", "--layers", "20-29", "--host", "0.0.0.0", "--advertise",
                           f"ws://{NAT_IP}:{tail_port}", *secret, "--join", f"http://{HOST_IP}:{head_port}", *EXACT,
                           name="nat tail", host=NAT_IP, port=tail_port, netns=behind_nat).wait_started()
        head.wait_ready(timeout=60)
        ids = chat_ids(tokenizer, "What is the capital of France?")
        deadline = time.monotonic() + 30
        while True:  # the route is planned once the head has both nodes' sockets; the relay pairs on first use
            try:
                tokens, _ = asyncio.run(complete_ids(head.url, ids, 24))
                break
            except AssertionError:
                assert time.monotonic() < deadline, head.health()
                time.sleep(0.5)
        assert tokens == golden(reference_model, ids, 24)
        middle_health = health_inside(middle_behind_nat, f"http://127.0.0.1:{middle_port}")
        [to_tail] = [link for link in middle_health["links"] if link["url"] == tail.ws_url]
        assert to_tail["formed"].startswith("relayed by") and to_tail["state"] == "up"
        assert to_tail["formed"].endswith("; sealed)")  # its frames carry MACs of its two ends' keys (`mesh.seal`)
        with urllib.request.urlopen(head.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        relayed = [line for line in metrics.splitlines()
                   if line.startswith('meshws_frame_bytes_total{direction="relayed"')]
        assert relayed and float(relayed[0].split()[-1]) > 1000

        # A joined node's view: no relay to an address that is not a joined node, none for a pair the head can
        # dial, no more waiting sockets than the cap.
        stranger = "ws://203.0.113.9:8701"
        assert asyncio.run(_refused(head.url, relay_path(stranger, middle.ws_url))) == 403
        assert asyncio.run(_refused(head.url, relay_path(tail.ws_url, stranger))) == 403
        assert asyncio.run(_refused(head.url, reverse_path(stranger))) == 403
        assert asyncio.run(_refused(head.url, reverse_path(tail.ws_url, stranger))) == 403
        # Another member (the secret, a key of its own) opens no relay socket in either node's name.
        assert asyncio.run(_refused(head.url, reverse_path(tail.ws_url, middle.ws_url), own=False)) == 403
        assert asyncio.run(_refused(head.url, relay_path(tail.ws_url, middle.ws_url), own=False)) == 403
        assert asyncio.run(_refused(head.url, reverse_path(tail.ws_url), own=False)) == 403
        statuses = asyncio.run(_flood_relay_backs(head.url, reverse_path(tail.ws_url, middle.ws_url), WAITING + 2))
        assert statuses.count(101) <= WAITING and statuses.count(403) >= 2
        assert asyncio.run(complete_ids(head.url, ids, 24))[0] == tokens  # and the mesh still answers
    finally:
        for node in (tail, middle, head):
            if node is not None:
                node.stop()


async def _flood_relay_backs(url, path, count):
    """`count` relay-back sockets for one pair opened at once, as the tail itself could (its key): each one's status
    (101: the head keeps it waiting)."""
    import aiohttp

    from meshws.mesh.auth import signed_headers

    statuses, sockets = [], []
    async with aiohttp.ClientSession() as client:
        for _ in range(count):
            headers = await signed_headers(client, url, SECRET, "GET", path, identity=_key())
            try:
                sockets.append(await client.ws_connect(url + path, headers=headers))
                statuses.append(101)
            except aiohttp.WSServerHandshakeError as exc:
                statuses.append(exc.status)
        for ws in sockets:
            await ws.close()
    return statuses


async def test_failover_onto_and_away_from_a_tail_behind_nat_keeps_the_answer(secret_file, behind_nat):
    """Two replica tails, one behind NAT: the serving one is SIGKILLed mid-answer, first the reachable one (the
    answer goes on on the tail behind NAT), then, restarted, the one behind NAT (it goes on on the other)."""
    import aiohttp

    from test_failover import STORY, stream_text

    secret = ("--secret-file", secret_file)
    head_port, nat_port, open_port = free_port(), free_port(), free_port()
    head = NodeProcess("--role", "head", "--layers", "0-9", "--host", "0.0.0.0", *secret, *EXACT,
                       "--registry-ttl", "4", name="head", port=head_port)
    tails: dict[str, NodeProcess] = {}

    def start(kind):
        if kind == "nat":
            tails[kind] = NodeProcess("--role", "tail", "--layers", "10-29", "--host", "0.0.0.0", "--advertise",
                                      f"ws://{NAT_IP}:{nat_port}", *secret, "--join", f"http://{HOST_IP}:{head_port}",
                                      *EXACT, name="nat tail", host=NAT_IP, port=nat_port, netns=behind_nat)
        else:  # (its address sorts first: with loads equal, the planner takes it)
            tails[kind] = NodeProcess("--role", "tail", "--layers", "10-29", "--host", "0.0.0.0", "--advertise",
                                      f"ws://{HOST_IP}:{open_port}", *secret, "--join", f"http://{HOST_IP}:{head_port}",
                                      *EXACT, name="open tail", port=open_port)
        tails[kind].wait_started()
        deadline = time.monotonic() + 30
        while sum(link["state"] == "up" for link in head.health()["links"]) < len(tails):  # every replica linked
            assert time.monotonic() < deadline, head.health()["links"]
            time.sleep(0.3)
        time.sleep(2.5)  # a heartbeat: the head knows every tail's load as it is

    def sessions(kind):
        if kind == "nat":
            return health_inside(behind_nat, f"http://127.0.0.1:{nat_port}")["sessions"]
        return tails[kind].health()["sessions"]

    killed, held = [], {}

    def kill_serving(chunks):
        if chunks >= 15 and len(killed) < answers:
            [serving] = [kind for kind in tails if sessions(kind) > held.get(kind, 0)]
            tails[serving].kill()
            killed.append(serving)

    try:
        head.wait_started()
        start("nat")
        start("open")
        messages = [{"role": "user", "content": STORY}]
        fault_free = await stream_text(head.url, messages, 60)
        await asyncio.sleep(2.5)
        answers = 1
        assert await stream_text(head.url, messages, 60, on_chunk=kill_serving) == fault_free
        start(killed[0])
        async with aiohttp.ClientSession() as client, client.ws_connect(f"{head.url}/ws/chat") as chat:
            # A conversation held on the reachable tail (its load, heartbeated) sends the next answer to the other.
            await chat.send_json({"type": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                  "temperature": 0})
            while (await chat.receive_json(timeout=60))["type"] != "done":
                pass
            held = {kind: sessions(kind) for kind in tails}
            await asyncio.sleep(2.5)
            answers = 2
            assert await stream_text(head.url, messages, 60, on_chunk=kill_serving) == fault_free
        assert killed == ["open", "nat"], (killed, held)  # onto the tail behind NAT, then away from it
    finally:
        for node in [*tails.values(), head]:
            node.stop()
