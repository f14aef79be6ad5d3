"""The public API under bad input and load: OpenAI-shaped 4xx for anything malformed, 503 at the limit."""

import asyncio
import time

import aiohttp
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
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
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
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
            json_type = {"Content-Type": "application/json"}
            async with client.post(url + "/v1/chat/completions", data=b"\xff\xfe{{{", headers=json_type) as response:
                assert response.status == 400
            async with client.post(url + "/v1/chat/completions", data=b"{}",
                                   headers={"Content-Type": "text/plain"}) as response:  # a no-cors fetch
                assert response.status == 415
            async with client.post(url + "/v1/chat/completions", data=b"x" * (9 * 1024 * 1024),
                                   headers=json_type) as response:
                assert response.status == 413
                assert "error" in await response.json()
            good = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            async with client.post(url + "/v1/chat/completions", json=good) as response:
                assert response.status == 200
        assert mesh.head.health()["status"] == "ok"


async def test_with_no_queue_the_admission_limit_answers_503_with_retry_after():
    class _SlowTail(LoopTailBackend):
        def answer(self, past_len):
            time.sleep(0.05)
            return super().answer(past_len)

    async with fake_mesh(CachedHeadBackend(), _SlowTail(), max_generations=1, max_queue=0) as mesh:
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
