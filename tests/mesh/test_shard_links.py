"""A shard's inbound links under pressure, with fake models: caps, early header checks, re-opens, lost hops.

The shards are real Nodes on loopback; the test speaks `/ws/shard` itself as the hop
before, so each edge case is sent exactly.
"""

import asyncio
import struct
import time
from contextlib import asynccontextmanager

import aiohttp
import orjson
import zstandard

from fakes import CachedTailBackend, FakeBackend, eventually
from meshws.config import NodeSettings
from meshws.mesh.wire import Hello, encode_control
from meshws.model.backend import TensorPayload
from meshws.node import Node


def _fwd(sid, step, past_len=0, positions=2, mode="prefill", body=None, enc=None, width=8):
    header = {"type": "fwd", "sid": sid, "step": step, "mode": mode, "past_len": past_len,
              "shape": [1, positions, width], "dtype": "bfloat16", "enc": enc}
    head = orjson.dumps(header)
    return struct.pack(">I", len(head)) + head + (bytes(positions * width * 2) if body is None else body)


@asynccontextmanager
async def _shard(backend, role="tail", layers=(6, 12), **settings):
    node = Node(NodeSettings(role=role, port=0, layers=layers, **settings), backend=backend)
    port = await node.start()
    try:
        yield node, port
    finally:
        await node.stop()


@asynccontextmanager
async def _link(port):
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"ws://127.0.0.1:{port}/ws/shard") as ws:
            await ws.send_str(encode_control(Hello("fake-model", (0, 6), "head", "tester", 12)))
            assert (await ws.receive_json(timeout=5))["type"] == "hello"
            yield ws


async def _open(ws, sid, **extra):
    await ws.send_str(orjson.dumps({"type": "open", "sid": sid, **extra}).decode())


def encode_control_close(sid):
    return orjson.dumps({"type": "close", "sid": sid}).decode()


async def _reply(ws, sid):
    while True:
        reply = await ws.receive_json(timeout=10)
        if reply.get("sid") == sid:
            return reply


class _CountingTail(CachedTailBackend):
    def __init__(self):
        super().__init__([])

    def answer(self, past_len):
        return self.__class__.token(past_len)

    @staticmethod
    def token(past_len):
        from meshws.model.backend import TailTokenResult

        return TailTokenResult("", 1 + (past_len or 0))


async def test_too_many_sessions_on_one_link_get_an_error_and_the_node_serves_on():
    tail = _CountingTail()
    async with _shard(tail, max_link_sessions=2) as (node, port):
        async with _link(port) as ws:
            for sid in ("a", "b", "c"):
                await _open(ws, sid)
            refused = await _reply(ws, "c")
            assert refused["type"] == "error" and "2 sessions" in refused["message"]
            await ws.send_bytes(_fwd("c", 1))
            assert "unknown session" in (await _reply(ws, "c"))["message"]
            await ws.send_bytes(_fwd("a", 1))
            assert (await _reply(ws, "a"))["type"] == "token"
            async with _link(port) as full:  # another link, full: its refused open of "a" leaves "a" alone
                for sid in ("x", "y", "a"):
                    await _open(full, sid)
                assert "2 sessions" in (await _reply(full, "a"))["message"]
            await ws.send_bytes(_fwd("a", 2))
            assert (await _reply(ws, "a"))["type"] == "token"
            await ws.send_str(encode_control_close("a"))
            await _open(ws, "c")  # a closed session frees its place
            await ws.send_bytes(_fwd("c", 2))
            assert (await _reply(ws, "c"))["type"] == "token"


async def test_a_header_beyond_the_context_or_of_the_wrong_width_is_refused_before_its_body_is_inflated():
    tail = _CountingTail()
    async with _shard(tail) as (node, port):
        async with _link(port) as ws:
            await _open(ws, "s")
            # The body is not zstd at all: inflating it would say so. The header check speaks first.
            await ws.send_bytes(_fwd("s", 1, mode="decode", past_len=2040, positions=9, body=b"junk", enc="zstd"))
            refused = await _reply(ws, "s")
            assert refused["type"] == "error" and "exceed the context of 2048" in refused["message"], refused
            await ws.send_bytes(_fwd("s", 2, positions=3, width=16, body=b"junk", enc="zstd"))
            assert "shape [1, tokens, 8]" in (await _reply(ws, "s"))["message"]
            ids_header = {"type": "fwd", "sid": "s", "step": 3, "mode": "prefill", "past_len": 0,
                          "shape": [1, 2, 8], "dtype": "bfloat16", "enc": None, "ids": [1, 100]}
            head = orjson.dumps(ids_header)
            await ws.send_bytes(struct.pack(">I", len(head)) + head + bytes(32))
            assert "vocabulary" in (await _reply(ws, "s"))["message"]
            await ws.send_bytes(_fwd("s", 4, positions=2))
            assert (await _reply(ws, "s"))["type"] == "token"  # the link and the session go on
            assert tail.calls and all(call["shape"] == [1, 2, 8] for call in tail.calls)
            # A well-formed zstd body still works.
            body = zstandard.ZstdCompressor().compress(bytes(2 * 8 * 2))
            await ws.send_bytes(_fwd("s", 5, positions=2, body=body, enc="zstd"))
            assert (await _reply(ws, "s"))["type"] == "token"


class _SlowPrefillTail(FakeBackend):
    """A tail whose prefill takes many slow chunks; it notes when each session is released."""

    is_tail = True

    def __init__(self, chunk_seconds):
        super().__init__()
        self.chunk_seconds = chunk_seconds
        self.released_at = {}

    def prefill(self, step, chunk_tokens):
        for _ in range(-(-step.length // chunk_tokens) - 1):
            time.sleep(self.chunk_seconds)
            yield
        time.sleep(self.chunk_seconds)
        return _CountingTail.token(step.length)

    def forward_bytes(self, body, shape, *, dtype="bfloat16", session_id=None, cache_mode=None, past_len=None,
                      sampling=None, history=(), generated_from=None):
        return _CountingTail.token(past_len)

    def release_session(self, session_id):
        self.released_at[session_id] = time.monotonic()
        return super().release_session(session_id)


async def test_a_close_during_a_long_prefill_is_released_within_a_chunk_and_the_link_stays():
    tail = _SlowPrefillTail(chunk_seconds=0.1)
    async with _shard(tail, prefill_chunk=16) as (node, port):
        async with _link(port) as ws:
            await _open(ws, "long")
            await _open(ws, "short")
            await ws.send_bytes(_fwd("long", 1, positions=16 * 30))  # 30 chunks: 3 s
            await asyncio.sleep(0.35)
            closed_at = time.monotonic()
            await ws.send_str(encode_control_close("short"))
            await eventually(lambda: "short" in tail.released_at, timeout=5)
            assert tail.released_at["short"] - closed_at < 0.35  # one chunk, not the rest of the prefill
            metrics = node.metrics.render().decode()
            answer = await _reply(ws, "long")
            assert answer["type"] == "token" and not ws.closed
    assert "meshws_compute_queued" in metrics
    assert node.worker.queued == 0  # nothing left waiting once the prefill answered


async def test_reopening_a_session_on_another_link_replaces_it_there():
    tail = _CountingTail()
    async with _shard(tail) as (node, port):
        async with _link(port) as first, _link(port) as second:
            await _open(first, "moved")
            await first.send_bytes(_fwd("moved", 1))
            assert (await _reply(first, "moved"))["type"] == "token"
            await _open(second, "moved")  # the head re-routed through a new link to this node
            await second.send_bytes(_fwd("moved", 2))
            assert (await _reply(second, "moved"))["type"] == "token"
            await first.send_str(encode_control_close("moved"))  # the old link no longer owns it
            await first.send_bytes(_fwd("moved", 3))
            assert "unknown session" in (await _reply(first, "moved"))["message"]
            await second.send_bytes(_fwd("moved", 4, mode="decode", past_len=2, positions=1))
            assert (await _reply(second, "moved"))["type"] == "token"
            assert tail.released.count("moved") == 1  # released once, when it moved


class _Middle(FakeBackend):
    start, end = 6, 9

    def prefill(self, step, chunk_tokens):
        return TensorPayload(body=bytes(step.length * 16), shape=[1, step.length, 8], past_len=step.past_len)
        yield

    def forward_bytes(self, body, shape, *, past_len=None, **ignored):  # a decode step: passed on as it came
        return TensorPayload(body=bytes(body), shape=list(shape), past_len=past_len or 0)


async def test_a_middle_whose_next_hop_is_unreachable_says_lost_with_that_hops_url():
    dead = "ws://127.0.0.1:9"  # nothing listens on the discard port
    async with _shard(_Middle(), role="middle", layers=(6, 9), peer=dead) as (node, port):
        async with _link(port) as ws:
            await _open(ws, "m")
            await ws.send_bytes(_fwd("m", 1))
            reply = await asyncio.wait_for(_reply(ws, "m"), 20)
    assert reply["type"] == "error" and reply.get("lost") is True, reply
    assert reply["url"] == dead and "unreachable" in reply["message"]


async def test_a_middle_whose_next_hop_never_answers_says_lost_with_that_hops_url():
    class _SilentTail(CachedTailBackend):
        def answer(self, past_len):
            if past_len:
                time.sleep(3.0)  # a decode step hangs past the middle's timeout
            return _CountingTail.token(past_len)

    async with _shard(_SilentTail([])) as (tail, tail_port):
        async with _shard(_Middle(), role="middle", layers=(6, 9), peer=f"ws://127.0.0.1:{tail_port}",
                          step_timeout=2.0) as (middle, port):
            async with _link(port) as ws:
                await _open(ws, "h")
                await ws.send_bytes(_fwd("h", 1))  # a prefill is judged by the head's timeout alone
                assert (await asyncio.wait_for(_reply(ws, "h"), 10))["type"] == "token"
                started = time.monotonic()
                await ws.send_bytes(_fwd("h", 2, mode="decode", past_len=2, positions=1))
                reply = await asyncio.wait_for(_reply(ws, "h"), 10)
                waited = time.monotonic() - started
    assert reply["type"] == "error" and reply.get("lost") is True, reply
    assert reply["url"] == f"ws://127.0.0.1:{tail_port}" and "no answer" in reply["message"]
    assert 0.9 < waited < 2.0  # the middle (one hop behind it) waits half the head's timeout


def test_hops_nearer_the_tail_wait_less_so_the_nearest_to_a_hang_speaks_first():
    from meshws.mesh.inbound import ShardLimits

    limits = ShardLimits(step_timeout=120.0)
    # head -> m1 -> m2 -> tail: the head waits 120 s, m1 (two hops behind it) 80 s, m2 (one) 60 s.
    assert [limits.hop_timeout(behind) for behind in (2, 1)] == [80.0, 60.0]
    assert all(limits.hop_timeout(n + 1) > limits.hop_timeout(n) for n in range(1, 8))
    assert all(limits.hop_timeout(n) < limits.step_timeout for n in range(1, 64))


async def test_a_step_cancelled_before_it_started_gives_its_in_flight_slot_back():
    tail = _CountingTail()
    async with _shard(tail, max_link_frames=1) as (node, port):
        async with _link(port) as ws:
            for round_ in range(4):  # a step and its session's close in one burst: the close cancels the step
                sid = f"gone-{round_}"
                await _open(ws, sid)
                await ws.send_bytes(_fwd(sid, 1))
                await ws.send_str(encode_control_close(sid))
            await _open(ws, "after")
            await ws.send_bytes(_fwd("after", 1))
            reply = await _reply(ws, "after")
            assert reply["type"] == "token", reply  # with the one slot leaked it would say "frames in flight"


async def test_a_large_body_is_inflated_off_the_event_loop(monkeypatch):
    import meshws.mesh.shard_steps as shard_steps

    off_loop = []
    real_to_thread = asyncio.to_thread

    async def recording_to_thread(fn, *args):
        off_loop.append(fn.__name__)
        return await real_to_thread(fn, *args)

    monkeypatch.setattr(shard_steps.asyncio, "to_thread", recording_to_thread)
    tail = _CountingTail()
    tail.hidden_size = 512
    async with _shard(tail) as (node, port):
        async with _link(port) as ws:
            await _open(ws, "big")
            body = zstandard.ZstdCompressor().compress(bytes(1024 * 512 * 2))  # 1 MiB once inflated
            await ws.send_bytes(_fwd("big", 1, positions=1024, width=512, body=body, enc="zstd"))
            assert (await _reply(ws, "big"))["type"] == "token"
            await ws.send_bytes(_fwd("big", 2, mode="decode", past_len=1024, positions=1, width=512))
            assert (await _reply(ws, "big"))["type"] == "token"
    # (the patch sees every to_thread of the process: the node's own shutdown too)
    assert off_loop.count("inflate_forward") == 1  # the large body off the loop; the one-token step inline
    assert tail.calls[0]["bytes"] == 1024 * 512 * 2


def _wave(rows, width=8):
    from meshws.mesh.wire import DecodeRow, encode_rows

    return encode_rows([DecodeRow(sid, step, past_len, bytes(width * 2), len(rows)) for sid, step, past_len in rows],
                       width, "bfloat16")


async def _replies(ws, sids, unnamed=None):
    """The first reply of each of `sids`, whatever order they come in (and into `unnamed`, frames naming no sid)."""
    found = {}
    while set(found) != set(sids):
        reply = await ws.receive_json(timeout=10)
        if reply.get("sid") in sids:
            found.setdefault(reply["sid"], reply)
        elif "sid" not in reply and unnamed is not None:
            unnamed.append(reply)
    return found


class _PoisonedTail(_CountingTail):
    """A tail whose model fails on one session's row (and, slowed, gives a close time to come mid-wave)."""

    def __init__(self, seconds=0.0):
        super().__init__()
        self.seconds = seconds

    def forward_bytes(self, body, shape, *, dtype="bfloat16", session_id=None, cache_mode=None, past_len=None,
                      sampling=None, history=(), generated_from=None):
        time.sleep(self.seconds)
        if session_id == "p":
            raise RuntimeError("a poisoned row (test)")
        return _CountingTail.token(past_len)


async def test_one_poisoned_row_of_a_wave_frame_fails_only_its_session():
    async with _shard(_PoisonedTail()) as (node, port):
        async with _link(port) as ws:
            for sid in ("a", "b", "p", "c"):
                await _open(ws, sid)
            await ws.send_bytes(_wave([("a", 1, 3), ("b", 1, 5000), ("p", 1, 3), ("d", 1, 3), ("c", 1, 6)]))
            unnamed = []
            replies = await _replies(ws, ("a", "b", "p", "c"), unnamed)
            assert (replies["a"]["type"], replies["a"]["token_id"]) == ("token", 4)
            assert (replies["c"]["type"], replies["c"]["token_id"]) == ("token", 7)
            assert replies["b"]["type"] == "error" and "exceed the context" in replies["b"]["message"]
            assert replies["p"]["type"] == "error" and "poisoned row" in replies["p"]["message"]
            assert len(unnamed) == 1 and "1 rows of a wave's frame for sessions not open" in unnamed[0]["message"]
            await ws.send_bytes(_wave([("x", 1, 3), ("y", 1, 3), ("z", 1, 3)]))  # strangers: one error, not three
            assert "3 rows of a wave's frame" in (await ws.receive_json(timeout=10))["message"]
            await ws.send_bytes(_wave([("a", 2, 4), ("c", 2, 7), ("b", 2, 5)]))  # the link and the sessions go on
            assert [reply["token_id"] for reply in (await _replies(ws, ("a", "c", "b"))).values()] == [5, 8, 6]


async def test_a_session_closed_while_its_wave_computes_leaves_the_others_untouched():
    tail = _PoisonedTail(seconds=0.2)
    async with _shard(tail) as (node, port):
        async with _link(port) as ws:
            for sid in ("a", "b", "c"):
                await _open(ws, sid)
            await ws.send_bytes(_wave([("a", 1, 3), ("b", 1, 3), ("c", 1, 3)]))
            await ws.send_str(encode_control_close("b"))
            replies = await _replies(ws, ("a", "c"))
            assert [replies[sid]["token_id"] for sid in ("a", "c")] == [4, 4]
            await eventually(lambda: "b" in tail.released and "b" not in node.shard_service.sessions)
            await ws.send_bytes(_wave([("a", 2, 4), ("c", 2, 4)]))
            assert [reply["token_id"] for reply in (await _replies(ws, ("a", "c"))).values()] == [5, 5]
            assert "a" not in tail.released and "c" not in tail.released


async def test_a_wave_frame_none_of_whose_rows_fit_is_refused_before_its_body_is_inflated():
    async with _shard(_CountingTail()) as (node, port):
        async with _link(port) as ws:
            for sid in ("a", "b"):
                await _open(ws, sid)
            header = orjson.dumps({"type": "fwd", "mode": "decode", "rows": [{"sid": "a", "step": 1, "past_len": 0},
                                   {"sid": "b", "step": 1, "past_len": 0}], "shape": [2, 1, 16],
                                   "dtype": "bfloat16", "enc": "zstd"})
            await ws.send_bytes(struct.pack(">I", len(header)) + header + b"junk")  # (not zstd at all)
            replies = await _replies(ws, ("a", "b"))
            assert all("shape [1, tokens, 8]" in reply["message"] for reply in replies.values()), replies


async def test_compressed_frames_beyond_the_nodes_inflation_budget_are_refused_and_the_link_goes_on(monkeypatch):
    from meshws.mesh import shard_steps

    monkeypatch.setattr(shard_steps, "INFLATED_BUDGET", 16)  # bytes: below one 2-position body (32)
    tail = _CountingTail()
    async with _shard(tail) as (node, port):
        async with _link(port) as ws:
            await _open(ws, "s")
            body = zstandard.ZstdCompressor().compress(bytes(2 * 8 * 2))
            await ws.send_bytes(_fwd("s", 1, positions=2, body=body, enc="zstd"))
            refused = await _reply(ws, "s")
            assert refused["type"] == "error" and "inflated" in refused["message"], refused
            await ws.send_bytes(_fwd("s", 2, positions=2))  # plain bodies cost their sender as much: not counted
            assert (await _reply(ws, "s"))["type"] == "token"


async def test_a_link_that_was_up_and_dropped_says_lost_on_a_send_as_its_subscribers_heard():
    from meshws.mesh.link import Link, LinkDown

    hello = Hello("fake-model", (0, 6), "head", "tester", 12)
    async with _shard(_CountingTail()) as (tail, port):
        link = Link(f"ws://127.0.0.1:{port}", lambda: hello, max_frame_bytes=1 << 20)
        link.start()
        try:
            assert await link.wait_up(10)
            heard = []
            link.subscribe("s", heard.append)
            await tail.stop()  # the peer goes away: the link drops
            await eventually(lambda: not link.is_up and heard)
            try:
                await link.send_control(Hello("fake-model", (0, 6), "head", "tester", 12))
            except LinkDown as exc:
                sent = str(exc)
            else:
                raise AssertionError("a send on a dropped link went through")
        finally:
            await link.close()
    assert "lost" in heard[0].message and sent.startswith(f"link to ws://127.0.0.1:{port} lost"), (heard, sent)
