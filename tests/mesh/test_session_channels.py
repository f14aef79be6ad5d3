"""The seed's HTTP-level tests, over websocket session channels, with fake backends.

Head and tail are real Nodes on loopback talking over real websockets; only the
model is faked, so each test pins one protocol behaviour.
"""

import asyncio
import time

import aiohttp
import orjson

from fakes import (
    BrokenTailBackend,
    CachedHeadBackend,
    CachedTailBackend,
    LegacyTailBackend,
    eventually,
    fake_mesh,
)
from meshws.head.stats import GenerationRequest, GenerationStats
from meshws.mesh.inbound import DecodeLogThrottle
from meshws.model.backend import TensorPayload


async def _chat_once(head_port: int, max_tokens: int, stream: bool = False):
    payload = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": max_tokens, "stream": stream}
    async with aiohttp.ClientSession() as client:
        async with client.post(f"http://127.0.0.1:{head_port}/v1/chat/completions", json=payload) as response:
            return response.status, await response.read()


def _content(body: bytes) -> str:
    return orjson.loads(body)["choices"][0]["message"]["content"]


async def test_session_is_stable_and_decode_payloads_are_single_token():
    head_backend = CachedHeadBackend()
    tail_backend = CachedTailBackend([(" a", 1), (" b", 2), (" c", 3)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=3)
        # The release follows the response over the link; it must come while the mesh runs.
        await eventually(lambda: tail_backend.released and head_backend.released)
    assert status == 200
    assert _content(body) == " a b c"
    assert len(tail_backend.calls) == 3
    # Step 0 is a full-prompt prefill; steps 1+ carry only the new token.
    assert tail_backend.calls[0]["mode"] == "prefill"
    assert tail_backend.calls[0]["shape"] == [1, 6, 8]
    for step, call in enumerate(tail_backend.calls[1:], start=1):
        assert call["mode"] == "decode"
        assert call["shape"] == [1, 1, 8]
        assert call["bytes"] == 16
        assert call["past_len"] == 6 + (step - 1)
    # One session id across every step of the generation.
    sessions = {call["session"] for call in tail_backend.calls}
    assert len(sessions) == 1
    session_id = sessions.pop()
    assert head_backend.prefills == [session_id]
    assert head_backend.decode_calls == [(1, session_id), (2, session_id)]
    # Head and tail release the session when the generation ends.
    assert head_backend.released == [session_id]
    assert tail_backend.released == [session_id]


async def test_the_next_step_runs_on_the_head_while_a_token_is_held_and_goes_no_further_if_the_consumer_stops():
    """A token's next decode step is queued on the head as the token arrives, not once the consumer (an SSE
    write) has taken it, so it joins its wave's batch. A consumer that stops there (a stop string) wastes
    only the head's step: nothing more reaches the tail, and the session is released everywhere."""
    head_backend = CachedHeadBackend()
    tail_backend = CachedTailBackend([(" a", 1), (" b", 2), (" c", 3)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        stats = GenerationStats(sid="early")
        events = mesh.head.head._generator.generate(GenerationRequest("hello", max_tokens=3), stats)
        first = await events.__anext__()
        await eventually(lambda: head_backend.decode_calls)  # the consumer has not asked for token 2 yet
        await events.aclose()
        await eventually(lambda: tail_backend.released and head_backend.released)
    assert first.token_id == 1
    assert head_backend.decode_calls == [(1, "early")]
    assert [call["mode"] for call in tail_backend.calls] == ["prefill"]
    assert head_backend.released == ["early"] and tail_backend.released == ["early"]


class _SlowTail(CachedTailBackend):
    def answer(self, past_len):
        time.sleep(0.3)  # (on the tail's worker)
        return super().answer(past_len)


async def test_a_consumer_that_stops_while_the_next_step_waits_its_turn_cancels_it_before_the_release():
    """Closed while its next head step still waits behind other work, a generation cancels that step before it
    releases the session: the step never runs, neither on the released session nor on a later answer's cache."""
    head_backend = CachedHeadBackend()
    tail_backend = _SlowTail([(" a", 1), (" b", 2), (" c", 3)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        events = mesh.head.head._generator.generate(GenerationRequest("hello", max_tokens=3), GenerationStats(sid="q"))
        first = asyncio.ensure_future(events.__anext__())
        await eventually(lambda: head_backend.prefills)  # the prompt is at the tail, which takes 0.3 s
        busy = asyncio.ensure_future(mesh.head.worker.call(time.sleep, 0.6))  # token 1's step will wait behind it
        assert (await first).token_id == 1
        await events.aclose()
        await busy
        await eventually(lambda: tail_backend.released and head_backend.released)
        await asyncio.sleep(0.1)
    assert head_backend.decode_calls == []
    assert head_backend.released == ["q"] and [call["mode"] for call in tail_backend.calls] == ["prefill"]


async def test_pipeline_failure_before_first_token_returns_502():
    """A dead hop must surface as an error, not an empty 200 completion."""
    head_backend = CachedHeadBackend()
    async with fake_mesh(head_backend, BrokenTailBackend([])) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=3)
    assert status == 502
    error = orjson.loads(body)["error"]
    assert error["message"].startswith("pipeline error:")
    assert "C compiler" in error["message"]
    assert error["type"] == "upstream_error"


async def test_pipeline_failure_in_stream_emits_error_frame():
    """Streaming requests get an OpenAI-style error frame before [DONE]."""
    head_backend = CachedHeadBackend()
    async with fake_mesh(head_backend, BrokenTailBackend([])) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=3, stream=True)
    assert status == 200
    events = body.decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    error_frame = orjson.loads(events[-2][len("data: "):])
    assert error_frame["error"]["type"] == "upstream_error"
    assert "C compiler" in error_frame["error"]["message"]


async def test_pipeline_failure_mid_stream_keeps_the_text_so_far():
    class _TailFailingLater(CachedTailBackend):
        def answer(self, past_len):
            if len(self.calls) == 3:
                raise RuntimeError("out of memory (test)")
            return super().answer(past_len)

    head_backend = CachedHeadBackend()
    async with fake_mesh(head_backend, _TailFailingLater([(" a", 1), (" b", 2), (" c", 3)])) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=5, stream=True)
    assert status == 200
    events = [e[len("data: "):] for e in body.decode().strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " a b"
    assert "out of memory" in orjson.loads(events[-2])["error"]["message"]


async def test_large_prefill_activation_survives_zstd_compressed_hop():
    """A prefill body above the threshold travels zstd-compressed and arrives whole."""

    class _BigHeadBackend(CachedHeadBackend):
        def encode_prompt(self, prompt, session_id=None, *, sampling=None, generated_from=None):
            self.prefills.append(session_id)
            if session_id:
                self._seq[session_id] = 2000
            # 125 KiB (and one decode step still fits the context)
            return TensorPayload(body=b"\x00" * (1 * 2000 * 32 * 2), shape=[1, 2000, 32])

        def encode_next_token(self, token_id, session_id, *, sampling=None, history=(), generated_from=None,
                              past_len=None):
            past = self._seq[session_id]
            self._seq[session_id] = past + 1
            return TensorPayload(body=b"\x00" * 64, shape=[1, 1, 32], past_len=past)

    head_backend = _BigHeadBackend()
    tail_backend = CachedTailBackend([(" a", 1), (" b", 2)])
    tail_backend.hidden_size = 32  # the width the shard checks in the header
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=2)
        sent = _metric(mesh.tail)
    assert status == 200
    assert _content(body) == " a b"
    assert tail_backend.calls[0]["mode"] == "prefill"
    assert tail_backend.calls[0]["shape"] == [1, 2000, 32]
    assert tail_backend.calls[0]["bytes"] == 2000 * 32 * 2
    assert sent < 20_000, "the 128 KiB prefill should have crossed compressed"


async def test_eos_token_id_stops_generation():
    head_backend = CachedHeadBackend()
    tail_backend = CachedTailBackend([(" a", 1), ("", 99)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=8)
    assert status == 200
    assert _content(body) == " a"
    assert orjson.loads(body)["choices"][0]["finish_reason"] == "stop"
    assert len(tail_backend.calls) == 2


async def test_stateless_fallback_stops_at_eos_token_id():
    """When kv caching is off, EOS must still stop generation by token id."""

    class _StatelessHead(CachedHeadBackend):
        supports_kv_cache = False

    head_backend = _StatelessHead()
    tail_backend = CachedTailBackend([(" a", 1), ("", 99), (" never", 3)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=8)
    assert status == 200
    assert _content(body) == " a"
    # Stops after the EOS step instead of burning steps until max_tokens.
    assert len(tail_backend.calls) == 2
    assert head_backend.decode_calls == []
    assert [call["mode"] for call in tail_backend.calls] == ["prefill", "prefill"]


def test_decode_forward_logging_is_rate_limited():
    """Shard nodes log a per-session decode summary, not one line per token."""
    throttle = DecodeLogThrottle()
    assert throttle.note("s1", now=0.0) == 1
    assert throttle.note("s1", now=1.0) is None
    assert throttle.note("s1", now=4.9) is None
    assert throttle.note("s1", now=5.5) == 4
    assert throttle.note("s1", now=6.0) is None
    # Sessions are throttled independently.
    assert throttle.note("s2", now=6.0) == 1


async def test_shard_service_rate_limits_through_note_decode_step():
    tail_backend = CachedTailBackend([])
    async with fake_mesh(CachedHeadBackend(), tail_backend) as mesh:
        srv = mesh.tail.shard_service
        assert srv.note_decode_step("s1", now=0.0) == 1
        assert srv.note_decode_step("s1", now=1.0) is None
        assert srv.note_decode_step("s1", now=5.5) == 3


async def test_downstream_cache_miss_falls_back_to_full_reprefill():
    head_backend = CachedHeadBackend()
    # Call 1 (the first decode) raises KVCacheMiss → cache_miss frame →
    # head re-prefills the full sequence and keeps generating.
    tail_backend = CachedTailBackend([(" a", 1), (" b", 2), (" c", 3)], miss_on_call=1)
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=3)
    assert status == 200
    assert _content(body) == " a b c"
    modes = [call["mode"] for call in tail_backend.calls]
    assert modes == ["prefill", "decode", "prefill", "decode"]
    # Head re-prefilled once, with the same stable session id.
    assert len(head_backend.prefills) == 2
    assert len(set(head_backend.prefills)) == 1
    assert len({call["session"] for call in tail_backend.calls}) == 1


async def test_kv_head_with_legacy_tail_reprefills_every_step():
    """Mixed fleet: tail predates the protocol and returns no token_id."""
    head_backend = CachedHeadBackend()
    tail_backend = LegacyTailBackend()
    async with fake_mesh(head_backend, tail_backend) as mesh:
        status, body = await _chat_once(mesh.head_port, max_tokens=5)
    assert status == 200
    assert _content(body) == " x x"
    # No token_id from the tail → every step is a full prefill (legacy cost),
    # never a decode against a cache the tail doesn't keep.
    assert head_backend.decode_calls == []
    assert len(head_backend.prefills) == 3


# -- helpers ------------------------------------------------------------------

def _metric(tail) -> float:
    """Bytes of prefill frames the tail received."""
    text = tail.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith('meshws_frame_bytes_total{direction="in",type="fwd_prefill"}'):
            return float(line.split()[-1])
    raise AssertionError("no fwd bytes metric")


async def test_a_draining_shard_refuses_new_sessions_as_lost_and_the_head_says_so():
    head_backend = CachedHeadBackend()
    tail_backend = CachedTailBackend([(" a", 1), (" b", 2)])
    async with fake_mesh(head_backend, tail_backend) as mesh:
        mesh.tail.shard_service.draining = True
        status, body = await _chat_once(mesh.head_port, max_tokens=2)
        assert status == 502
        assert "shutting down" in orjson.loads(body)["error"]["message"]
        assert tail_backend.calls == []  # nothing computed for a session it refused
        mesh.tail.shard_service.draining = False
        status, body = await _chat_once(mesh.head_port, max_tokens=2)
    assert status == 200 and _content(body) == " a b"
