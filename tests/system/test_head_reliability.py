"""The head under departed, slow and many clients, with real node processes and the embedded model.

Long prompts whose clients hang up leave the head idle within seconds; an SSE client that stops
reading is dropped after --write-timeout; many short sessions leave every node's memory where it
was after the first wave (400 sessions in CI, under a minute on two cores;
MESHWS_SOAK_SESSIONS=10000 or more runs a longer soak).
"""

import asyncio
import os
import socket
import time

import openai
import orjson
import pytest

from helpers import EXACT, MODEL
from meshws.tools.launch import Mesh

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

WRITE_TIMEOUT = 2
LONG_TEXT = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 125  # ~2k tokens


@pytest.fixture(scope="module")
def mesh(embedded_model):
    # float32: on CPUs without native bf16 (AVX2 only), a bf16 prefill of 2k tokens takes tens of seconds
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT,
                extra={"head": ("--write-timeout", str(WRITE_TIMEOUT))})
    yield mesh
    mesh.stop()


def _client(mesh, **options):
    return openai.AsyncOpenAI(base_url=f"{mesh.head.url}/v1", api_key="unused", max_retries=0, **options)


async def _wait(check, timeout):
    """Seconds until `check()` held (polled), or AssertionError after `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not true within {timeout} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def _idle(node):
    health = node.health()
    return health.get("generations", 0) == 0 and health.get("queued", 0) == 0 and health["sessions"] == 0


async def test_twenty_long_prompts_hung_up_after_half_a_second_leave_the_head_idle_within_seconds(mesh):
    client = _client(mesh, timeout=120)

    async def short():
        started = time.monotonic()
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        assert answer.choices[0].message.content
        return time.monotonic() - started

    await short()  # warm
    before = min([await short() for _ in range(3)])
    started = time.monotonic()
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"{LONG_TEXT} Summarise."}],
                                         max_tokens=1)
    one_long = time.monotonic() - started  # what one long prompt costs; twenty served would cost twenty times it
    impatient = _client(mesh, timeout=0.5)

    async def hang_up(index):
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{index}. {LONG_TEXT} Summarise."}],
                max_tokens=64, temperature=0)

    await asyncio.gather(*(hang_up(index) for index in range(20)))
    # At most the prefill running when the clients left finishes; the others never start.
    idle_after = await _wait(lambda: _idle(mesh.head), timeout=one_long + 5)
    await _wait(lambda: mesh.tail.health()["sessions"] == 0, timeout=10)
    after = min([await short() for _ in range(3)])
    print(f"short request {before * 1000:.0f} ms before, {after * 1000:.0f} ms after; one long prompt "
          f"{one_long:.1f} s; head idle {idle_after:.1f} s after the hang-ups")
    assert after < 3 * before + 0.1, (before, after)


async def test_an_sse_client_that_stops_reading_is_dropped_within_the_write_timeout(mesh):
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                         "max_tokens": 1500, "ignore_eos": True, "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", mesh.head.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{mesh.head.port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:  # it never reads a byte
        await _wait(lambda: mesh.head.health()["generations"] == 1, timeout=10)
        dropped = await _wait(lambda: _idle(mesh.head), timeout=60)
        for node in mesh.nodes:
            await _wait(lambda: node.health()["sessions"] == 0, timeout=10)
        assert any(f"read nothing for {WRITE_TIMEOUT} s" in line for line in mesh.head.lines), mesh.head.lines[-12:]
        tokens = [line for line in mesh.head.lines if "generation" in line and "completion tokens" in line][-1]
        assert "+ 1500 completion" not in tokens, tokens  # cut short, not served to the end
        print(f"a client that reads nothing dropped {dropped:.0f} s into its answer: {tokens}")
    finally:
        sock.close()


def _rss_kib(node):
    with open(f"/proc/{node.proc.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


async def test_many_short_sessions_leave_memory_where_the_first_wave_left_it(mesh):
    total = int(os.environ.get("MESHWS_SOAK_SESSIONS", "400"))  # (a leaked cache, 100 KB+ a session, shows)
    client = _client(mesh, timeout=120)

    async def one(index):
        # Short raw prompts: what is soaked is opening and closing sessions, not prefill compute.
        answer = await client.completions.create(model=MODEL, prompt=f"{index % 7 + 1}, ", max_tokens=1 + index % 2,
                                                 temperature=0)
        assert answer.usage.completion_tokens >= 1

    started, baseline, done = time.monotonic(), None, 0
    while done < total:
        wave = min(32, total - done)
        await asyncio.gather(*(one(done + index) for index in range(wave)))
        done += wave
        if baseline is None:
            await _wait(lambda: all(_idle(node) for node in mesh.nodes), timeout=10)
            baseline = {node.name: _rss_kib(node) for node in mesh.nodes}
            kept = {node.name: node.health()["cache_bytes"] for node in mesh.nodes}  # (earlier tests' prefixes)
    for node in mesh.nodes:
        await _wait(lambda: _idle(node), timeout=10)
        assert node.health()["cache_bytes"] <= kept[node.name], "short prompts keep nothing (no whole 64-token block)"
    final = {node.name: _rss_kib(node) for node in mesh.nodes}
    print(f"{total} sessions in {time.monotonic() - started:.0f} s; RSS KiB after the first wave {baseline}, "
          f"at the end {final}")
    for name, kib in final.items():
        assert kib <= baseline[name] * 1.05, (name, baseline[name], kib)
