"""Fake backends for protocol tests (the seed's, with the few attributes meshws reads)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from contextlib import asynccontextmanager

import aiohttp

from meshws.cache_store import KVCacheMiss, SessionCacheStore
from meshws.config import NodeSettings
from meshws.node import Node
from meshws.shard import TailTokenResult, TensorPayload

TEXTS = {1: " a", 2: " b", 3: " c", 99: ""}


class ChatTokenizer:
    eos_token = ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "debug prompt"


class CachedHeadBackend:
    model_id = "fake-model"
    total_layers = 12
    start, end = 0, 6
    is_head = True
    is_tail = False
    supports_kv_cache = True
    tokenizer = ChatTokenizer()

    def __init__(self) -> None:
        self.prefills: list[str | None] = []
        self.decode_calls: list[tuple[int, str]] = []
        self.released: list[str] = []
        self._seq: dict[str, int] = {}
        self.sessions = SessionCacheStore()

    def eos_token_ids(self) -> list[int]:
        return [99]

    def tokenize(self, text: str) -> list[int]:
        return [5] * 6

    def decode(self, ids) -> str:
        return "".join(TEXTS.get(i, f"<{i}>") for i in ids)

    def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    def encode_prompt(self, prompt, session_id=None, **kwargs) -> TensorPayload:
        self.prefills.append(session_id)
        if session_id:
            self._seq[session_id] = 6
        return TensorPayload(body=b"\x00" * (1 * 6 * 8 * 2), shape=[1, 6, 8])

    def encode_next_token(self, token_id: int, session_id: str, **kwargs) -> TensorPayload:
        self.decode_calls.append((token_id, session_id))
        past = self._seq[session_id]
        self._seq[session_id] = past + 1
        return TensorPayload(body=b"\x00" * (1 * 1 * 8 * 2), shape=[1, 1, 8], past_len=past)


class CachedTailBackend:
    model_id = "fake-model"
    total_layers = 12
    start, end = 6, 12
    is_head = False
    is_tail = True
    supports_kv_cache = True

    def __init__(self, tokens, miss_on_call: int | None = None) -> None:
        self._tokens = list(tokens)
        self.miss_on_call = miss_on_call
        self.calls: list[dict] = []
        self.released: list[str] = []
        self.sessions = SessionCacheStore()

    def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    def forward_bytes(self, body, shape, attention_mask_header, position_ids_header, start_layer=None,
                      session_id=None, cache_mode=None, past_len=None, **kwargs):
        call_index = len(self.calls)
        self.calls.append({"session": session_id, "mode": cache_mode, "past_len": past_len, "shape": list(shape),
                           "bytes": len(body)})
        if self.miss_on_call is not None and call_index == self.miss_on_call:
            raise KVCacheMiss("session evicted (test)")
        text, token_id = self._tokens.pop(0)
        return TailTokenResult(text=text, token_id=token_id)


class BrokenTailBackend(CachedTailBackend):
    """Tail whose forward always fails (e.g. missing compiler, OOM)."""

    def forward_bytes(self, *args, **kwargs):
        raise RuntimeError("Failed to find C compiler (test)")


class LegacyTailBackend:
    """A tail that predates the protocol: returns text, no token id."""

    model_id = "fake-model"
    total_layers = 12
    start, end = 6, 12
    is_head = False
    is_tail = True

    def __init__(self) -> None:
        self.calls = 0

    def release_session(self, session_id: str) -> None:
        pass

    def forward_bytes(self, body, shape, attention_mask_header, position_ids_header, start_layer=None, **kwargs):
        self.calls += 1
        return " x" if self.calls < 3 else ""


@dataclass
class FakeMesh:
    head: Node
    tail: Node
    head_port: int
    tail_port: int


@asynccontextmanager
async def fake_mesh(head_backend, tail_backend, **head_settings):
    """A head and a tail Node on loopback, in this event loop, over real websockets."""
    tail = Node(NodeSettings(role="tail", port=0, layers=(6, 12)), backend=tail_backend)
    tail_port = await tail.start()
    head = Node(NodeSettings(role="head", port=0, layers=(0, 6), peer=f"ws://127.0.0.1:{tail_port}",
                             **head_settings), backend=head_backend)
    head_port = await head.start()
    try:
        await wait_ready(head_port)
        yield FakeMesh(head, tail, head_port, tail_port)
    finally:
        await head.stop()
        await tail.stop()


async def wait_ready(port: int, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as client:
        while True:
            async with client.get(f"http://127.0.0.1:{port}/health") as response:
                health = await response.json()
            if health["ready"]:
                return health
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"node on {port} not ready: {health['problems']}")
            await asyncio.sleep(0.05)
