"""Nothing a client sends comes back amplified: /ws/chat ids are bounded (they are echoed in every frame of a turn),
and errors quote a client's strings cut short (on fake shards)."""

import aiohttp
import pytest

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh
from meshws.api.chat_ws import MAX_ID_CHARS
from meshws.api.errors import ECHO_CHARS, shown

HI = [{"role": "user", "content": "hi"}]
HUGE = "x" * 1_000_000


@pytest.mark.parametrize("value, cut", [("short", False), (HUGE, True), (["a" * 500], True), (7, False)])
def test_a_quoted_value_is_its_repr_cut_short(value, cut):
    text = shown(value)
    assert len(text) <= ECHO_CHARS and text.endswith("\u2026") == cut
    assert cut or text == repr(value)


async def test_a_long_or_odd_id_is_refused_before_anything_runs_and_a_fair_one_is_echoed():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        async with aiohttp.ClientSession() as client, client.ws_connect(url + "/ws/chat", max_msg_size=0) as ws:
            for bad in ("i" * (MAX_ID_CHARS + 1), HUGE, True, 2**70, 1.5, ["x"], {"a": 1}):
                for kind in ("chat", "reset", "render"):
                    await ws.send_json({"type": kind, "id": bad, "messages": HI, "text": "hi", "max_tokens": 3})
                    reply = await ws.receive_json()
                    assert reply["type"] == "error" and reply["param"] == "id" and "id" not in reply, reply
                    assert len(str(reply)) < 200
            await ws.send_json({"type": HUGE})
            reply = await ws.receive_json()
            assert reply["type"] == "error" and "unknown message type" in reply["message"]
            assert len(reply["message"]) < 200
            await ws.send_json({"type": "chat", "messages": HI, "model": HUGE, "max_tokens": 3})
            reply = await ws.receive_json()
            assert reply["type"] == "error" and "does not exist" in reply["message"] and len(str(reply)) < 400
            fair = "f" * MAX_ID_CHARS
            await ws.send_json({"type": "chat", "id": fair, "messages": HI, "max_tokens": 3})
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(await ws.receive_json())
            assert frames[0]["type"] == "start" and frames[-1]["type"] == "done"
            assert all(frame["id"] == fair for frame in frames)
            for turn_id in (-(2**63), 2**64 - 1):
                await ws.send_json({"type": "reset", "id": turn_id})
                assert await ws.receive_json() == {"type": "reset", "id": turn_id}


async def test_errors_of_the_http_api_quote_a_clients_strings_cut_short():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        async with aiohttp.ClientSession() as client:
            for body in ({"model": HUGE, "messages": HI}, {"model": "m", "messages": [{"role": HUGE, "content": "x"}]},
                         {"model": "m", "messages": HI, HUGE: 1},
                         {"model": "m", "messages": [{"role": "user", "content": "x", HUGE: 1}]}):
                async with client.post(url + "/v1/chat/completions", json=body) as answer:
                    text = await answer.text()
                    assert answer.status in (400, 404) and len(text) < 1000, text[:300]  # (of a 1 MB field)
