"""Joining a head: records are checked and clamped, the registry is bounded, and a link must confirm its record."""

import asyncio
import json

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh
from meshws.head import membership
from meshws.head.membership import RegistryEndpoints, _record
from meshws.head.registry import Registry

GOOD = {"url": "ws://127.0.0.1:9", "node": "tail@x", "model": "fake-model", "layers": [6, 12], "load": 2}


@pytest.mark.parametrize("change, needle", [
    ({"load": -1e15}, "load"),
    ({"load": float("inf")}, "load"),
    ({"capacity": -1}, "capacity"),
    ({"load": "lots"}, "load"),
    ({"layers": [6, "12"]}, "layers"),
    ({"url": "http://127.0.0.1:9"}, "url"),
    ({"role": "head"}, "role"),
    ({"model": 5}, "model"),
    ({"measured": {"layer_ms": -1.0}}, "layer_ms"),
    ({"measured": {"layer_ms": float("nan")}}, "layer_ms"),
    ({"measured": {"layer_ms": float("inf")}}, "layer_ms"),
    ({"measured": {"layer_ms": 1e12}}, "layer_ms"),
    ({"measured": {"layer_ms": 0.0}}, "layer_ms"),
    ({"measured": {}}, "layer_ms"),
    ({"measured": {"layer_ms": 2.0, "memory": -5}}, "memory"),
    ({"measured": {"layer_ms": 2.0, "memory": 2**60}}, "memory"),
    ({"measured": {"layer_ms": 2.0, "memory": 1.5e9}}, "memory"),
    ({"measured": {"layer_ms": 2.0, "link_ms": -3}}, "link_ms"),
    ({"measured": {"layer_ms": 2.0, "lm_head_ms": float("nan")}}, "lm_head_ms"),
    ({"measured": "fast"}, "measured"),
    ({"auto": "yes"}, "auto"),
    ({"roles": ["head"]}, "roles"),
    ({"roles": []}, "roles"),
    ({"plan": {"serving": -1}}, "serving"),
    ({"plan": {"prepared": 1.5}}, "prepared"),
])
def test_bad_join_records_are_refused_with_the_field(change, needle):
    with pytest.raises(ValueError, match=needle):
        _record({**GOOD, **change})


def test_a_join_carries_measured_capacity():
    record = _record({**GOOD, "auto": True, "roles": ["middle"], "plan": {"serving": 3, "prepared": 4},
                      "measured": {"layer_ms": 2.5, "memory": 300 * 2**20, "link_ms": 0.4, "lm_head_ms": 7.0}})
    assert (record.auto, record.roles, record.serving, record.prepared) == (True, ("middle",), 3, 4)
    assert (record.layer_seconds, record.memory, record.link_seconds, record.lm_head_seconds) == \
        (0.0025, 300 * 2**20, 0.0004, 0.007)


def test_huge_loads_are_clamped():
    assert _record({**GOOD, "load": 1e300}).load == membership.MAX_LOAD


async def test_joins_over_http_are_checked_bounded_and_never_500(monkeypatch):
    monkeypatch.setattr(membership, "MAX_NODES", 3)
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}/mesh/join"
        json_type = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as client:
            for body, status in [(b'{"load": Infinity}', 400), (orjson.dumps({**GOOD, "layers": [6, 40]}), 400),
                                 (orjson.dumps({**GOOD, "load": -1}), 400), (b"[]", 400)]:
                async with client.post(url, data=body, headers=json_type) as response:
                    assert response.status == status, body
            for port in range(3):
                async with client.post(url, json={**GOOD, "url": f"ws://127.0.0.1:{port + 1}"}) as response:
                    assert response.status == 200
            async with client.post(url, json={**GOOD, "url": "ws://127.0.0.1:99"}) as response:
                assert response.status == 503 and "full" in (await response.json())["error"]
        assert len(mesh.head.registry.nodes()) == 3
        # a body that arrives in two segments is read whole (a join with a secret is checked on all of it)
        body = orjson.dumps({**GOOD, "url": "ws://127.0.0.1:1"})
        reader, writer = await asyncio.open_connection("127.0.0.1", mesh.head_port)
        writer.write(b"POST /mesh/join HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(body[10:])
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_a_link_that_contradicts_its_record_drops_it():
    registry = Registry("fake-model", 12)
    left = []
    endpoints = RegistryEndpoints(registry, on_join=lambda record: None, on_leave=left.append,
                                  authorize=lambda request, body: None)
    registry.announce(_record(GOOD))
    assert endpoints.check_link("ws://127.0.0.1:9", "fake-model", (6, 12))
    assert not endpoints.check_link("ws://127.0.0.1:9", "fake-model", (9, 12))  # it claimed 6-11
    assert registry.nodes() == [] and left == ["ws://127.0.0.1:9"]


def test_a_record_that_expires_while_being_read_fires_leave_handling_once(caplog):
    now = [100.0]
    registry = Registry("fake-model", 12, ttl=6.0, clock=lambda: now[0])
    left = []
    RegistryEndpoints(registry, on_join=lambda record: None, on_leave=left.append,
                      authorize=lambda request, body: None)
    registry.announce(_record(GOOD))
    registry.announce(_record({**GOOD, "url": "ws://127.0.0.1:10"}))
    now[0] += 4
    registry.announce(_record({**GOOD, "url": "ws://127.0.0.1:10"}))  # this one keeps its heartbeat
    now[0] += 3  # the first is silent for 7 s: it expires on the next read, before the expiry loop runs
    with caplog.at_level("WARNING", logger="meshws.membership"):
        assert [r.url for r in registry.nodes()] == ["ws://127.0.0.1:10"]
    assert left == ["ws://127.0.0.1:9"]  # its link is closed: the head stops re-dialing it
    assert "stopped answering" in caplog.text
    assert registry.expire() == [] and [r.url for r in registry.nodes()] == ["ws://127.0.0.1:10"]
    assert left == ["ws://127.0.0.1:9"]  # told once


def test_a_silent_nodes_url_stays_bound_to_its_key_for_a_grace_and_a_leave_frees_it(monkeypatch):
    from meshws.head import registry as registry_module
    from meshws.head.registry import BIND_GRACE

    now = [100.0]
    registry = Registry("fake-model", 12, ttl=6.0, clock=lambda: now[0])
    RegistryEndpoints(registry, on_join=lambda record: None, on_leave=lambda url: None,
                      authorize=lambda request, body: None)
    record = _record(GOOD)
    record.key = "a" * 64
    registry.announce(record)
    now[0] += 7  # silent past the TTL: its record goes, its binding stays
    assert registry.nodes() == [] and registry.key_of(record.url) is None
    assert registry.bound_key(record.url) == "a" * 64
    now[0] += BIND_GRACE + 1
    assert registry.bound_key(record.url) is None  # the grace is over
    registry.announce(record)
    assert registry.leave(record.url) and registry.bound_key(record.url) is None  # it left: free at once
    registry.announce(record)
    assert registry.leave(record.url, keep_binding=True) and registry.bound_key(record.url) == "a" * 64
    # A flood of throwaway URLs gone silent does not push a binding out within its grace: new URLs wait instead.
    monkeypatch.setattr(registry_module, "LAPSED_MAX", 3)
    for n in range(5):
        junk = _record({**GOOD, "url": f"ws://junk-{n}.invalid:1"})
        junk.key = "b" * 64
        registry.announce(junk)
        now[0] += 7
        registry.nodes()
    assert registry.bound_key(record.url) == "a" * 64 and registry.crowded


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


async def test_fuzzed_join_bodies_get_4xx_and_the_head_keeps_serving():
    bodies = []

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.fixed_dictionaries({}, optional={key: json_values for key in
                                               ("url", "node", "model", "layers", "role", "load", "capacity")}))
    def collect(body):
        bodies.append(body)

    collect()
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        async with aiohttp.ClientSession() as client:
            for body in bodies:
                data = json.dumps(body).encode()  # NaN, Infinity and huge integers included
                async with client.post(f"{url}/mesh/join", data=data,
                                       headers={"Content-Type": "application/json"}) as response:
                    assert response.status in (200, 400, 503), (body, await response.text())
            async with client.post(f"{url}/v1/chat/completions",
                                   json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2}) as response:
                assert response.status == 200
