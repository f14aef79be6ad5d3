"""Admission over HTTP on fake shards: beyond --max-generations requests wait in line; only a full
queue or a timeout gets 503; a queued client that hangs up leaves at once; a slot is held until the
session's release has run."""

import asyncio
import time

import aiohttp

from fakes import CachedHeadBackend, LoopTailBackend, eventually, fake_mesh

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


class SlowTail(LoopTailBackend):
    """' a' per step after `delay` seconds, EOS at past_len 8 (about four steps)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def answer(self, past_len):
        time.sleep(self.delay)
        return super().answer(past_len)


async def _post(client, url, body=BODY):
    async with client.post(url, json=body) as response:
        return response.status, response.headers.get("Retry-After"), await response.json()


async def test_a_burst_beyond_the_limit_waits_in_line_and_only_a_full_queue_gets_503():
    async with fake_mesh(CachedHeadBackend(), SlowTail(0.2), max_generations=1, max_queue=2) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            running = asyncio.create_task(_post(client, url))
            await eventually(lambda: mesh.head.health()["generations"] == 1)
            queued = [asyncio.create_task(_post(client, url)) for _ in range(2)]
            await eventually(lambda: mesh.head.health()["queued"] == 2)
            await asyncio.sleep(0.1)
            assert mesh.head.health()["longest_wait_s"] >= 0.1  # how long the first in line has waited
            started = time.monotonic()
            refused = await asyncio.gather(_post(client, url), _post(client, url))
            assert time.monotonic() - started < 0.3  # refused at once, not after a wait
            for status, retry_after, answer in refused:
                assert status == 503 and int(retry_after) >= 1, (status, retry_after)
                assert answer["error"]["code"] == "queue_full"
            served = await asyncio.gather(running, *queued)
            assert [status for status, _, _ in served] == [200, 200, 200]
            assert {answer["choices"][0]["message"]["content"] for _, _, answer in served} == {" a a a"}
            async with client.get(f"http://127.0.0.1:{mesh.head_port}/metrics") as response:
                metrics = await response.text()
        assert 'meshws_admission_refused_total{reason="queue_full"} 2.0' in metrics
        assert "meshws_queue_depth 0.0" in metrics and "meshws_queue_wait_seconds_count 3.0" in metrics
        health = mesh.head.health()
        assert (health["generations"], health["queued"], health["max_queue"]) == (0, 0, 2)


class CountingHead(CachedHeadBackend):
    def __init__(self) -> None:
        super().__init__()
        self.tokenized = 0

    def tokenize(self, text):
        self.tokenized += 1
        return super().tokenize(text)


async def test_a_queued_client_that_hangs_up_leaves_the_queue_at_once_and_costs_no_work():
    head_backend = CountingHead()
    async with fake_mesh(head_backend, SlowTail(0.3), max_generations=1, max_queue=2) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            running = asyncio.create_task(_post(client, url))
            await eventually(lambda: mesh.head.health()["generations"] == 1)
            waiting = asyncio.create_task(_post(client, url))
            await eventually(lambda: mesh.head.health()["queued"] == 1)
            waiting.cancel()  # the client hangs up while it waits
            left = time.monotonic()
            await eventually(lambda: mesh.head.health()["queued"] == 0, timeout=2)
            assert time.monotonic() - left < 0.5
            assert mesh.head.health()["generations"] == 1  # the first one still runs: the queue did not just drain
            status, _, _ = await running
            assert status == 200
        assert mesh.head.health()["generations"] == 0
        assert head_backend.tokenized == 1 and len(head_backend.prefills) == 1  # the departed one: nothing


async def test_a_ws_chat_turn_waits_in_line_and_leaves_it_on_stop_or_when_its_socket_closes():
    async with fake_mesh(CachedHeadBackend(), SlowTail(0.3), max_generations=1, max_queue=2) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        turn = {"type": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as client:
            running = asyncio.create_task(_post(client, url + "/v1/chat/completions"))
            await eventually(lambda: mesh.head.health()["generations"] == 1)
            closing = await client.ws_connect(url + "/ws/chat")
            await closing.send_json(turn)
            await eventually(lambda: mesh.head.health()["queued"] == 1)
            await closing.close()  # the page is closed while its turn waits
            await eventually(lambda: mesh.head.health()["queued"] == 0, timeout=1)
            async with client.ws_connect(url + "/ws/chat") as ws:
                await ws.send_json(turn)
                await eventually(lambda: mesh.head.health()["queued"] == 1)
                await ws.send_json({"type": "stop"})
                await eventually(lambda: mesh.head.health()["queued"] == 0, timeout=1)
                assert mesh.head.health()["generations"] == 1  # still the HTTP request, served meanwhile
                await ws.send_json(turn)  # waits its turn, then runs
                kinds = []
                while not kinds or kinds[-1] not in ("done", "error"):
                    kinds.append((await asyncio.wait_for(ws.receive_json(), 10))["type"])
                assert kinds[0] == "start" and kinds[-1] == "done", kinds
            assert (await running)[0] == 200
        assert mesh.head.health()["generations"] == 0


async def test_a_wait_beyond_the_queue_timeout_gets_503_with_retry_after():
    async with fake_mesh(CachedHeadBackend(), SlowTail(0.4), max_generations=1, queue_timeout=0.3) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            running = asyncio.create_task(_post(client, url))
            await eventually(lambda: mesh.head.health()["generations"] == 1)
            started = time.monotonic()
            status, retry_after, answer = await _post(client, url)
            waited = time.monotonic() - started
            assert status == 503 and retry_after is not None and answer["error"]["code"] == "queue_timeout"
            assert 0.25 < waited < 1.2, waited
            assert not running.done()  # refused by the timeout, not served late
            assert (await running)[0] == 200


async def test_the_slot_stays_taken_until_the_session_release_has_run():
    class SlowRelease(CachedHeadBackend):
        def release_session(self, session_id):
            time.sleep(0.5)
            return super().release_session(session_id)

    head_backend = SlowRelease()
    async with fake_mesh(head_backend, SlowTail(0.05)) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        seen = []
        async with aiohttp.ClientSession() as client:
            async with client.post(url, json=dict(BODY, stream=True)) as response:
                await response.content.readline()  # the first chunk: the generation runs
                response.close()  # the client goes away
        deadline = time.monotonic() + 5
        while mesh.head.health()["generations"] and time.monotonic() < deadline:
            seen.append(len(head_backend.released))
            await asyncio.sleep(0.02)
        assert mesh.head.health()["generations"] == 0
        assert seen and seen[0] == 0  # it was still releasing, and counted as running meanwhile
        assert len(head_backend.released) == 1  # by the time the slot was free, the release had run


async def test_n_choices_take_a_slot_each_or_are_refused_at_once():
    """Each choice is a generation: n = 2 on a head with two slots runs, n = 3 is a 503 (not a queue of
    sessions beyond what the shards were sized for), and every slot is free again afterwards."""
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend(), max_generations=2) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/v1/chat/completions"
        async with aiohttp.ClientSession() as client:
            status, _, answer = await _post(client, url, {**BODY, "n": 2})
            assert status == 200 and [choice["index"] for choice in answer["choices"]] == [0, 1]
            status, retry_after, answer = await _post(client, url, {**BODY, "n": 3})
            assert status == 503 and retry_after and answer["error"]["code"] == "queue_full"
        assert mesh.head.head.queue.running == 0
