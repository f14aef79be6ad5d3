"""Heads that share shards and heads that stop, as real processes on the embedded model.

A tail started with `--join A,B` serves both heads (several heads behind one load
balancer share a pool of shards); when it dies, each head drops it from its registry,
its /health and its links. SIGTERM on the head and the tail during a generation lets
the generation finish (each node drains), refuses new connections meanwhile, and both
exit 0.
"""

import asyncio
import signal
import socket
import time

import aiohttp
import openai
import orjson
import pytest

from helpers import EXACT, MODEL
from meshws.tools.launch import Mesh, NodeProcess, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


def _until(check, timeout):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(0.1)


def test_two_heads_share_a_tail_joined_to_both_and_drop_it_when_it_dies(embedded_model):
    ports = [free_port(), free_port()]
    heads = [NodeProcess("--role", "head", "--layers", "0-14", "--registry-ttl", "5", "--threads", "1", *EXACT,
                         name=f"head {index}", port=port) for index, port in enumerate(ports)]
    joins = ",".join(f"http://127.0.0.1:{port}" for port in ports)
    tail = NodeProcess("--role", "tail", "--layers", "15-29", "--join", joins, "--threads", "1", *EXACT, name="tail")
    try:
        for node in (*heads, tail):
            node.wait_started()
        answers = []
        for head in heads:
            head.wait_ready(60)
            client = openai.OpenAI(base_url=f"{head.url}/v1", api_key="unused", max_retries=0, timeout=120)
            answer = client.chat.completions.create(model=MODEL,
                                                    messages=[{"role": "user", "content": "Name a colour."}],
                                                    max_tokens=8, temperature=0)
            answers.append(answer.choices[0].message.content)
        assert answers[0] and answers[0] == answers[1]  # one pool of shards, the same greedy answer from either head
        health = tail.health()
        assert health["joined"] and health["joined_heads"] == sorted(f"http://127.0.0.1:{port}" for port in ports)
        tail.kill()
        for head in heads:  # its heartbeats stop: each head forgets it, closes its link, stops re-dialing
            _until(lambda: not head.health()["nodes"] and not head.health()["links"], timeout=12)
            assert not head.health()["ready"]
            assert any("stopped answering; removed from the registry" in line for line in head.lines)
    finally:
        for node in (*heads, tail):
            node.stop()


async def test_sigterm_on_head_and_tail_during_a_generation_lets_it_finish_and_both_exit_0(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=EXACT)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 40,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage, done, refused = 0, None, False, False
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                async for line in response.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {"):
                        chunk = orjson.loads(line[6:])
                        assert "error" not in chunk, chunk
                        usage = chunk.get("usage") or usage
                        chunks += 1
                        if chunks == 3:
                            for node in mesh.nodes:
                                node.proc.send_signal(signal.SIGTERM)
                        elif chunks > 6 and not refused:  # draining: the port takes no new connections
                            with pytest.raises(ConnectionRefusedError):
                                socket.create_connection(("127.0.0.1", mesh.head.port), timeout=2).close()
                            refused = True
        assert done and refused and usage["completion_tokens"] == 40  # the whole answer, after the SIGTERMs
        for node in mesh.nodes:
            assert await asyncio.to_thread(node.proc.wait, 60) == 0
            assert any("draining" in line for line in node.lines), node.name
    finally:
        mesh.stop()
