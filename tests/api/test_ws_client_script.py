"""examples/ws_client.py, run as a new user runs it: a head it cannot reach or that refuses it is one line, no
traceback."""

import socket
import subprocess
import sys

from fakes import CachedHeadBackend, CachedTailBackend, fake_mesh
from helpers import ROOT


def _client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/ws_client.py", *args, "hello"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_head_is_one_line():
    port = _closed_port()
    result = _client("--url", f"http://127.0.0.1:{port}/ws/chat")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"cannot reach the head at ws://127.0.0.1:{port}/ws/chat")


def test_a_bad_address_is_one_line():
    result = _client("--url", "ftp://example.org")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is not a head's address" in result.stderr


async def test_a_head_that_wants_a_key_says_so():
    import asyncio

    async with fake_mesh(CachedHeadBackend(), CachedTailBackend([(" a", 1), ("", 99)]), api_key="sekrit") as fake:
        url = f"ws://127.0.0.1:{fake.head_port}/ws/chat"
        refused = await asyncio.to_thread(_client, "--url", url)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert refused.stderr.strip() == f"{url} answered 401 Unauthorized; give the head's --api-key with --api-key"
        answered = await asyncio.to_thread(_client, "--url", url, "--api-key", "sekrit", "--temperature", "0")
        assert answered.returncode == 0, answered.stderr
        assert "a" in answered.stdout
