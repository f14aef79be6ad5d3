"""Fake shard backends for protocol tests: they follow `ShardBackend` exactly (see
`mesh/test_fakes_follow_the_protocol.py`) and fake only the model."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Sequence

import aiohttp

from meshws.config import NodeSettings
from meshws.model.backend import (
    DecodeStep,
    PrefillRun,
    PrefillStep,
    StepResult,
    TailTokenResult,
    TensorPayload,
    decode_alone,
    prefill_at_once,
)
from meshws.model.kv.cache_store import KVCacheMiss, SessionCacheStore
from meshws.model.text.sampling_params import SamplingParams
from meshws.node import Node

TEXTS = {1: " a", 2: " b", 3: " c", 99: ""}


class ChatTokenizer:
    eos_token = ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "debug prompt"


class FakeBackend:
    """Every member of `ShardBackend`, with the defaults of a 12-layer fake model; steps must be overridden."""

    model_id = "fake-model"
    total_layers = 12
    start, end = 0, 12
    is_head = is_tail = False
    context_length = 2048
    vocab_size = 100
    hidden_size = 8
    supports_kv_cache = True
    supports_batching = False
    weight_bytes = 0
    compute_facts = {"path": "fake"}
    costs = None  # (not measured: its steps are scripted, and no placement runs on it)
    lm_head_seconds = 0.0

    def prepare_span(self, start: int, end: int):
        raise ValueError("a fake backend does not move")

    def adopt(self, parts) -> int:
        raise ValueError("a fake backend does not move")

    def weight_facts(self):
        return {"source": "fake", "mapped_bytes": 0, "resident_bytes": 0}
    tokenizer = None

    def __init__(self) -> None:
        self.sessions = SessionCacheStore()
        self.released: list[str] = []

    def eos_token_ids(self) -> list[int]:
        return [99]

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError("this fake holds no tokenizer")

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(TEXTS.get(i, f"<{i}>") for i in token_ids)

    def encode_prompt(self, prompt: str | Sequence[int], session_id: str | None = None, *,
                      sampling: SamplingParams | None = None, generated_from: int | None = None) -> StepResult:
        raise NotImplementedError("this fake is not a head")

    def encode_next_token(self, token_id: int, session_id: str, *, sampling: SamplingParams | None = None,
                          history: Sequence[int] = (), generated_from: int | None = None,
                          past_len: int | None = None) -> StepResult:
        raise NotImplementedError("this fake is not a head")

    def forward_bytes(self, body: bytes, shape: Sequence[int], *, dtype: str = "bfloat16",
                      session_id: str | None = None, cache_mode: str | None = None, past_len: int | None = None,
                      sampling: SamplingParams | None = None, history: Sequence[int] = (),
                      generated_from: int | None = None) -> StepResult:
        raise NotImplementedError("this fake receives no hidden states")

    def prefill(self, step: PrefillStep, chunk_tokens: int) -> PrefillRun:
        return prefill_at_once(self, step)

    def prefills_together(self, step: PrefillStep) -> bool:
        return False  # each prefill on its own: `prefill`

    def prefill_batch(self, steps: Sequence[PrefillStep],
                      decodes: Sequence[DecodeStep] = ()) -> list[StepResult | Exception]:
        raise NotImplementedError("this fake prefills one session at a time")

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StepResult | Exception]:
        results: list[StepResult | Exception] = []
        for step in steps:
            try:
                results.append(decode_alone(self, step))
            except Exception as exc:
                results.append(exc)
        return results

    def release_session(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True

    def fork_session(self, parent_id: str, session_id: str, length: int) -> bool:
        return False  # no cache to copy: a fork's first step misses and re-prefills


class CachedHeadBackend(FakeBackend):
    start, end = 0, 6
    is_head = True
    tokenizer = ChatTokenizer()

    def __init__(self) -> None:
        super().__init__()
        self.prefills: list[str | None] = []
        self.decode_calls: list[tuple[int, str]] = []
        self._seq: dict[str, int] = {}

    def tokenize(self, text: str) -> list[int]:
        return [5] * 6

    def encode_prompt(self, prompt: str | Sequence[int], session_id: str | None = None, *,
                      sampling: SamplingParams | None = None, generated_from: int | None = None) -> StepResult:
        self.prefills.append(session_id)
        if session_id:
            self._seq[session_id] = 6
        return TensorPayload(body=b"\x00" * (1 * 6 * 8 * 2), shape=[1, 6, 8])

    def encode_next_token(self, token_id: int, session_id: str, *, sampling: SamplingParams | None = None,
                          history: Sequence[int] = (), generated_from: int | None = None,
                          past_len: int | None = None) -> StepResult:
        self.decode_calls.append((token_id, session_id))
        past = self._seq[session_id] if past_len is None else past_len
        self._seq[session_id] = past + 1
        return TensorPayload(body=b"\x00" * (1 * 1 * 8 * 2), shape=[1, 1, 8], past_len=past)

    def prefill(self, step: PrefillStep, chunk_tokens: int) -> PrefillRun:
        if step.mode != "decode" or step.token_ids is None:
            return prefill_at_once(self, step)
        return self._extend(step)

    def _extend(self, step: PrefillStep) -> PrefillRun:
        """Several positions at `past_len` (a lap with drafts, a conversation's next turn)."""
        count = len(step.token_ids or ())
        self._seq[step.session_id or ""] = step.past_len + count
        return TensorPayload(body=b"\x00" * (count * 8 * 2), shape=[1, count, 8], past_len=step.past_len)
        yield  # a generator that never pauses


class CachedTailBackend(FakeBackend):
    start, end = 6, 12
    is_tail = True

    def __init__(self, tokens, miss_on_call: int | None = None) -> None:
        super().__init__()
        self._tokens = list(tokens)
        self.miss_on_call = miss_on_call
        self.calls: list[dict] = []

    def forward_bytes(self, body: bytes, shape: Sequence[int], *, dtype: str = "bfloat16",
                      session_id: str | None = None, cache_mode: str | None = None, past_len: int | None = None,
                      sampling: SamplingParams | None = None, history: Sequence[int] = (),
                      generated_from: int | None = None) -> StepResult:
        call_index = len(self.calls)
        self.calls.append({"session": session_id, "mode": cache_mode, "past_len": past_len, "shape": list(shape),
                           "bytes": len(body)})
        if self.miss_on_call is not None and call_index == self.miss_on_call:
            raise KVCacheMiss("session evicted (test)")
        return self.answer(past_len)

    def answer(self, past_len: int | None) -> StepResult:
        text, token_id = self._tokens.pop(0)
        return TailTokenResult(text=text, token_id=token_id)


class BrokenTailBackend(CachedTailBackend):
    """Tail whose forward always fails (e.g. missing compiler, OOM)."""

    def answer(self, past_len: int | None) -> StepResult:
        raise RuntimeError("Failed to find C compiler (test)")


class LoopTailBackend(CachedTailBackend):
    """A tail that answers ' a' until past_len 8, then EOS (for fuzzing the API quickly)."""

    def __init__(self) -> None:
        super().__init__([])

    def answer(self, past_len: int | None) -> StepResult:
        return TailTokenResult(" a", 99 if (past_len or 0) >= 8 else 1)


class LegacyTailBackend(FakeBackend):
    """A tail that predates the protocol: answers text, no token id (an empty text is its EOS)."""

    start, end = 6, 12
    is_tail = True
    supports_kv_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward_bytes(self, body: bytes, shape: Sequence[int], *, dtype: str = "bfloat16",
                      session_id: str | None = None, cache_mode: str | None = None, past_len: int | None = None,
                      sampling: SamplingParams | None = None, history: Sequence[int] = (),
                      generated_from: int | None = None) -> StepResult:
        self.calls += 1
        return TailTokenResult(" x" if self.calls < 3 else "", None)


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


async def eventually(check, timeout: float = 10.0) -> None:
    """Wait until `check()` is true: for effects that follow a response, like a shard's release."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        await asyncio.sleep(0.02)


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
