"""A real tail process under a long prompt: other sessions keep decoding, a close is released at once,
pings are answered, and per-link caps answer with error frames while the node serves on.

The test speaks `/ws/shard` as the hop before (hidden states of the real width), so it
can time every answer of every session on one link.
"""

import asyncio
import struct
import time

import aiohttp
import orjson
import numpy as np
import pytest

from meshws.mesh.wire import Hello, encode_control
from meshws.tools.launch import NodeProcess

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

MODEL = "SmolLM2-135M-Instruct"
HIDDEN = 576
LONG = 3072  # positions of the long prefill: 12 chunks of the default 256
LINK_SESSIONS = 4


@pytest.fixture(scope="module")
def tail(embedded_model):
    # float32: on CPUs without native bf16 it is the faster one; one thread: spinning OpenMP threads of a
    # busy machine (other nodes, other tests) slow a timed prefill far more than a thread fewer does.
    node = NodeProcess("--role", "tail", "--layers", "15-29", "--dtype", "float32", "--threads", "1",
                       "--max-link-sessions", str(LINK_SESSIONS), name="tail").wait_started()
    node.wait_ready()
    yield node
    assert node.proc.poll() is None, "the tail died:\n" + "\n".join(node.lines[-30:])
    node.stop()


def _bf16(positions, width=HIDDEN, seed=0):
    """Random hidden states as bf16 bytes, made with numpy (no torch threads spinning beside the tail)."""
    values = np.random.default_rng(seed).standard_normal((positions, width), dtype=np.float32) * 0.5
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _fwd(sid, step, positions, past_len=0, mode="prefill", width=HIDDEN):
    body = _bf16(positions, width, seed=step)
    header = orjson.dumps({"type": "fwd", "sid": sid, "step": step, "mode": mode, "past_len": past_len,
                           "shape": [1, positions, width], "dtype": "bfloat16", "enc": None})
    return struct.pack(">I", len(header)) + header + body


class _Hop:
    """The test's end of one link to the tail: replies sorted by session, with their arrival times."""

    def __init__(self, ws):
        self.ws = ws
        self.replies: dict[str, asyncio.Queue] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self):
        async for message in self.ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                reply = orjson.loads(message.data)
                self.queue(reply.get("sid")).put_nowait((time.monotonic(), reply))

    def queue(self, sid):
        return self.replies.setdefault(sid, asyncio.Queue())

    async def open(self, sid):
        await self.ws.send_str(orjson.dumps({"type": "open", "sid": sid}).decode())

    async def close(self, sid):
        await self.ws.send_str(orjson.dumps({"type": "close", "sid": sid}).decode())

    async def reply(self, sid, timeout=60):
        return await asyncio.wait_for(self.queue(sid).get(), timeout)

    async def step(self, sid, step, positions, past_len=0, mode="prefill"):
        await self.ws.send_bytes(_fwd(sid, step, positions, past_len, mode))
        return await self.reply(sid)


async def _logged(node, text, timeout):
    """When `text` first shows in the node's output (polled here)."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in node.lines):
        assert time.monotonic() < deadline, f"{text!r} not logged within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic()


async def _connect(client, tail, heartbeat=None):
    ws = await client.ws_connect(f"{tail.ws_url}/ws/shard", heartbeat=heartbeat, max_msg_size=0)
    await ws.send_str(encode_control(Hello(MODEL, (0, 15), "head", "tester", 30)))
    assert (await ws.receive_json(timeout=10))["type"] == "hello"
    return _Hop(ws)


async def test_a_long_prefill_lets_other_sessions_decode_and_a_close_through_without_dropping_the_link(tail):
    async with aiohttp.ClientSession() as client:
        # A 2 s heartbeat: the link drops if the tail leaves a ping unanswered for 1 s.
        hop = await _connect(client, tail, heartbeat=2.0)
        for sid in ("short", "closing", "long"):
            await hop.open(sid)
        for sid in ("short", "closing"):
            assert (await hop.step(sid, 1, 16))[1]["type"] == "token"
        assert tail.wait_sessions(2)["sessions"] == 2

        async def decode_until(done: asyncio.Future) -> list[float]:
            times, past = [], 16
            while not done.done():
                at, reply = await hop.step("short", past, 1, past_len=past, mode="decode")
                assert reply["type"] == "token", reply
                times.append(at)
                past += 1
            return times

        sent = time.monotonic()
        await hop.ws.send_bytes(_fwd("long", 1, LONG))
        long_answer = asyncio.ensure_future(hop.reply("long", timeout=120))
        decoding = asyncio.ensure_future(decode_until(long_answer))
        await asyncio.sleep(1.0)
        await hop.close("closing")
        # The tail logs a session's summary once its caches are released (watched in its output, not over HTTP).
        released_at = await _logged(tail, "session closing closed", timeout=60)
        answered_at, answer = await long_answer
        times = await decoding
        link_up = not hop.ws.closed
        assert (await hop.step("short", 99, 4))[1]["type"] == "token"  # the link still serves
        sessions = tail.health()["sessions"]

    assert answer["type"] == "token", answer
    prefill_seconds = answered_at - sent
    chunk_seconds = prefill_seconds / (LONG // 256)  # the mean chunk, measured in this run
    during = [t for t in times if sent < t <= answered_at]
    gaps = [b - a for a, b in zip([sent, *during], during)]
    print(f"prefill of {LONG}: {prefill_seconds:.2f} s, mean chunk {chunk_seconds:.3f} s, other session: "
          f"{len(during)} tokens, gaps {[round(g, 2) for g in gaps]} s (max {max(gaps):.2f}); "
          f"close released {answered_at - released_at:.2f} s "
          f"before the prefill ended")
    assert len(during) >= 5, f"only {len(during)} tokens of the other session during a {prefill_seconds:.1f} s prefill"
    assert max(gaps) < 4 * chunk_seconds, (max(gaps), chunk_seconds, prefill_seconds)
    assert prefill_seconds > 2.5 * max(gaps)  # without chunks the other session would wait the whole prefill
    assert released_at < answered_at - chunk_seconds, "the close waited for the long prefill"
    assert sessions == 2  # short and long: the closed one is gone
    assert link_up, "the link dropped during the prefill"


async def test_link_caps_and_a_header_beyond_the_context_get_errors_and_the_tail_serves_on(tail):
    async with aiohttp.ClientSession() as client:
        hop = await _connect(client, tail)
        for index in range(LINK_SESSIONS + 1):
            await hop.open(f"cap-{index}")
        refused = (await hop.reply(f"cap-{LINK_SESSIONS}", timeout=10))[1]
        assert refused["type"] == "error" and f"{LINK_SESSIONS} sessions" in refused["message"], refused

        # A header claiming past_len + n beyond the context; the body is far too short, and is never read.
        header = orjson.dumps({"type": "fwd", "sid": "cap-0", "step": 1, "mode": "decode", "past_len": 8190,
                               "shape": [1, 4, HIDDEN], "dtype": "bfloat16", "enc": "zstd"})
        await hop.ws.send_bytes(struct.pack(">I", len(header)) + header + b"not zstd")
        refused = (await hop.reply("cap-0", timeout=10))[1]
        assert refused["type"] == "error" and "exceed the context of 8192" in refused["message"], refused

        answer = (await hop.step("cap-0", 2, 8))[1]
        assert answer["type"] == "token" and isinstance(answer["token_id"], int)
        await hop.ws.close()
    assert tail.wait_sessions(0)["sessions"] == 0
    assert tail.health()["ready"]
