"""Hardening: the mesh secret, fuzzed frames and requests, admission limits, and load with aborts."""

import asyncio
import random
import struct
import time

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import CachedHeadBackend, fake_mesh
from meshws.auth import HEADER, Verifier, sign
from meshws.cache_store import SessionCacheStore
from meshws.config import NodeSettings
from meshws.node import Node
from meshws.shard import TailTokenResult
from meshws.wire import FrameError, decode_control, decode_forward, encode_forward


# -- the secret ----------------------------------------------------------------


def test_verifier_accepts_a_fresh_header_once_and_refuses_the_rest():
    verifier = Verifier("s3cret")
    header = sign("s3cret", "/ws/shard")
    assert verifier.check(header, "/ws/shard") is None
    assert "replay" in verifier.check(header, "/ws/shard")
    assert "wrong mesh secret" in verifier.check(sign("guess", "/ws/shard"), "/ws/shard")
    assert "wrong mesh secret" in verifier.check(sign("s3cret", "/mesh/join"), "/ws/shard")  # bound to its path
    assert "missing" in verifier.check(None, "/ws/shard")
    assert "too old" in verifier.check(sign("s3cret", "/ws/shard", now=time.time() - 3600), "/ws/shard")
    assert "malformed" in verifier.check("not-a-header", "/ws/shard")
    assert Verifier(None).check(None, "/ws/shard") is None  # no secret set: open


class _LoopTail:
    """A tail that answers ' a' until past_len 8, then EOS (for fuzzing the API quickly)."""

    model_id = "fake-model"
    total_layers = 12
    start, end = 6, 12
    is_head, is_tail, supports_kv_cache = False, True, True

    def __init__(self) -> None:
        self.sessions = SessionCacheStore()

    def release_session(self, session_id):
        pass

    def forward_bytes(self, body, shape, mask, positions, start_layer=None, session_id=None, cache_mode=None,
                      past_len=None, **kwargs):
        return TailTokenResult(" a", 99 if (past_len or 0) >= 8 else 1)


async def test_links_and_joins_need_the_secret(caplog):
    tail = Node(NodeSettings(role="tail", port=0, layers=(6, 12), secret="right"), backend=_LoopTail())
    tail_port = await tail.start()
    wrong = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret="wrong"), backend=CachedHeadBackend())
    await wrong.start()
    try:
        await asyncio.sleep(1.0)
        link = wrong.links.all()[0]
        assert link.state != "up" and "401" in (link.last_error or "")
        assert not wrong.health()["ready"]
        assert tail.health()["inbound_links"] == 0
        assert "refused /ws/shard" in caplog.text
        async with aiohttp.ClientSession() as client:  # no header at all
            async with client.get(f"http://127.0.0.1:{tail_port}/ws/shard") as response:
                assert response.status == 401
    finally:
        await wrong.stop()
    right = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                              secret="right"), backend=CachedHeadBackend())
    head_port = await right.start()
    try:
        from fakes import wait_ready

        await wait_ready(head_port)
        join = {"url": "ws://127.0.0.1:1", "node": "x", "model": "fake-model", "layers": [6, 12]}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join) as response:
                assert response.status == 401
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join,
                                   headers={HEADER: sign("wrong", "/mesh/join")}) as response:
                assert response.status == 401
            async with client.post(f"http://127.0.0.1:{head_port}/mesh/join", json=join,
                                   headers={HEADER: sign("right", "/mesh/join")}) as response:
                assert response.status == 200
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            async with client.post(f"http://127.0.0.1:{head_port}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        await right.stop()
        await tail.stop()


# -- fuzzing the frame parser -----------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_binary_frames_raise_only_frame_errors(data):
    try:
        decode_forward(data, max_frame_bytes=10_000)
    except FrameError:
        pass


def _valid_frame():
    return encode_forward("sid-1", 3, "decode", 7, [1, 1, 8], "bfloat16", bytes(16))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 200))
def test_mutated_tensor_frames_raise_only_frame_errors(flips, cut):
    data = bytearray(_valid_frame())
    for position, value in flips:
        data[position % len(data)] = value
    try:
        frame = decode_forward(bytes(data[: len(data) - cut % 8]))
    except FrameError:
        return
    assert len(frame.body) == 16  # whatever parses is consistent with its own shape and dtype


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
control_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["hello", "open", "token", "cache_miss", "error", "close", "fwd", "nope"])},
    optional={"sid": json_values, "step": json_values, "token_id": json_values, "version": json_values,
              "model": json_values, "layers": json_values, "route": json_values, "sampling": json_values,
              "message": json_values, "prompt_tokens": json_values},
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(control_frames.map(lambda m: orjson.dumps(m).decode()), st.text(max_size=80)))
def test_random_control_frames_raise_only_frame_errors(text):
    try:
        decode_control(text)
    except FrameError:
        pass


# -- fuzzing a live node's /ws/shard -------------------------------------------------


def _frame(header, body):
    head = orjson.dumps(header)
    return struct.pack(">I", len(head)) + head + body


def _mutations(seed: int):
    rng = random.Random(seed)
    good = {"type": "fwd", "sid": "fz", "step": 1, "mode": "prefill", "past_len": 0, "shape": [1, 2, 576],
            "dtype": "bfloat16", "enc": None}
    frames = []
    for _ in range(25):
        kind = rng.randrange(6)
        if kind == 0:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))))
        elif kind == 1:
            data = bytearray(_frame(good, bytes(2304)))
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frames.append(bytes(data))
        elif kind == 2:
            header = dict(good, **{rng.choice(list(good)): rng.choice([None, -1, "x", [], {}, 10**12, 2.5])})
            frames.append(_frame(header, bytes(2304)))
        elif kind == 3:
            frames.append(orjson.dumps({rng.choice(["type", "sid", "x"]): rng.choice(["open", "close", 5, None])}).decode())
        elif kind == 4:
            frames.append("".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 40))))
        else:
            frames.append(_frame(dict(good, shape=[1, rng.randrange(1, 4), 576]), bytes(rng.randrange(0, 5000))))
    return frames


@pytest.mark.real_model
@pytest.mark.processes
async def test_fuzzed_frames_on_a_live_tail_get_errors_and_generation_still_works(embedded_model):
    import torch

    from meshws.launch import Mesh

    mesh = Mesh([("head", "0-14"), ("tail", "15-29")])
    try:
        async with aiohttp.ClientSession() as client:
            for seed in range(4):
                async with client.ws_connect(f"{mesh.tail.ws_url}/ws/shard") as ws:
                    await ws.send_str(orjson.dumps({"type": "hello", "version": 1, "model": "SmolLM2-135M-Instruct",
                                                    "node": "fuzzer"}).decode())
                    assert (await ws.receive_json())["type"] == "hello"
                    await ws.send_str('{"type": "open", "sid": "fz"}')
                    for frame in _mutations(seed):
                        await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
                    # A well-formed step after the noise: the link still serves it.
                    body = torch.randn(1, 2, 576).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
                    sentinel = f"sentinel-{seed}"
                    await ws.send_str(orjson.dumps({"type": "open", "sid": sentinel}).decode())
                    await ws.send_bytes(_frame({"type": "fwd", "sid": sentinel, "step": 9, "mode": "prefill",
                                                "past_len": 0, "shape": [1, 2, 576], "dtype": "bfloat16",
                                                "enc": None}, body))
                    errors = 0
                    while True:
                        reply = await asyncio.wait_for(ws.receive_json(), 30)
                        assert reply["type"] in ("error", "token", "cache_miss"), reply
                        errors += reply["type"] == "error"
                        if reply.get("sid") == sentinel:
                            assert reply["type"] == "token", reply
                            break
                    assert errors >= 10
        assert mesh.tail.wait_sessions(0)["sessions"] == 0  # the fuzzing links closed: all released
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
    finally:
        mesh.stop()


# -- fuzzing the public API -------------------------------------------------------------

api_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["fake-model", "other", 3, None]),
        "messages": st.one_of(json_values, st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot", 1]),
             "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)),
        "prompt": json_values,
        "max_tokens": st.one_of(st.integers(-5, 5000), json_values),
        "max_completion_tokens": st.one_of(st.integers(-5, 50), json_values),
        "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), json_values),
        "top_p": json_values, "top_k": json_values, "seed": json_values, "stop": json_values,
        "stream": st.one_of(st.booleans(), json_values), "n": json_values,
        "stream_options": json_values, "frequency_penalty": json_values, "logprobs": json_values,
    },
)


async def test_fuzzed_api_requests_get_answers_never_server_errors():
    async with fake_mesh(CachedHeadBackend(), _LoopTail()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        bodies = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(api_fields, st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
        def collect(body, path):
            bodies.append((path, body))

        collect()
        async with aiohttp.ClientSession() as client:
            for path, body in bodies:
                async with client.post(url + path, data=orjson.dumps(body),
                                       headers={"Content-Type": "application/json"}) as response:
                    text = await response.read()
                    assert response.status in (200, 400, 404), (response.status, body, text)
                    if response.status != 200:
                        error = orjson.loads(text)["error"]
                        assert set(error) == {"message", "type", "param", "code"}
            async with client.post(url + "/v1/chat/completions", data=b"\xff\xfe{{{") as response:
                assert response.status == 400
            async with client.post(url + "/v1/chat/completions", data=b"x" * (9 * 1024 * 1024)) as response:
                assert response.status == 413
                assert "error" in await response.json()
            good = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            async with client.post(url + "/v1/chat/completions", json=good) as response:
                assert response.status == 200
        assert mesh.head.health()["status"] == "ok"


async def test_admission_limit_answers_503_with_retry_after():
    class _SlowTail(_LoopTail):
        def forward_bytes(self, *args, **kwargs):
            time.sleep(0.05)
            return super().forward_bytes(*args, **kwargs)

    async with fake_mesh(CachedHeadBackend(), _SlowTail(), max_generations=1) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        async with aiohttp.ClientSession() as client:
            async def post():
                async with client.post(url, json=body) as response:
                    return response.status, response.headers.get("Retry-After")

            first = asyncio.create_task(post())
            await asyncio.sleep(0.1)
            second = await post()
            assert (await first)[0] == 200
        assert second == (503, "1")


# -- load with aborts ----------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.processes
async def test_load_64_streams_a_third_abort_everything_else_correct_and_nothing_leaks(embedded_model):
    from meshws.launch import Mesh

    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=("--dtype", "float32", "--wire-dtype", "float32"),
                extra={"head": ("--max-generations", "64")})
    prompts = ["Name a colour.", "Name an animal.", "Name a fruit.", "Name a country."]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            async def stream(prompt, abort_after=None):
                body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 12, "temperature": 0, "stream": True}
                parts, chunks = [], 0
                async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = orjson.loads(line[6:])
                        assert "error" not in chunk, chunk
                        chunks += 1
                        if chunk["choices"]:
                            parts.append(chunk["choices"][0]["delta"].get("content") or "")
                        if abort_after is not None and chunks >= abort_after:
                            response.close()  # the client goes away mid-stream
                            return None
                return "".join(parts)

            expected = {prompt: await stream(prompt) for prompt in prompts}
            rng = random.Random(7)
            plan = [(prompts[i % 4], rng.randrange(1, 8) if i % 3 == 0 else None) for i in range(64)]
            started = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(stream(p, a) for p, a in plan)), 420)
            elapsed = time.monotonic() - started
        finished = [(p, r) for (p, a), r in zip(plan, results) if a is None]
        assert len(finished) == 42
        assert all(result == expected[prompt] for prompt, result in finished)
        for node in mesh.nodes:
            health = node.wait_sessions(0, timeout=10)
            assert health["sessions"] == 0 and health["cache_bytes"] == 0, health
        head = mesh.head.health()
        assert head["generations"] == 0
        tail = mesh.tail.health()
        assert tail["channels"] == 0 and tail["pending_tasks"] == 0 and tail["inbound_links"] == 1
        print(f"64 streams (21 aborted) in {elapsed:.1f} s")
    finally:
        mesh.stop()
