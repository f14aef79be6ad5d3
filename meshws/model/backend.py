"""The compute boundary: what the transport and the head may call on a shard, and the step types.

`ShardBackend` lists exactly what `mesh` and `head` use; `ModelShard` implements it,
and so do the test fakes (a type checker, or `tests/mesh/test_fakes_follow_the_protocol`,
flags one that drifts). Capabilities are attributes of the protocol, never probed:
`supports_kv_cache` (the cached path works on this hardware) and `supports_batching`
(`decode_batch` runs rows as one forward rather than one by one).

A long prefill runs in chunks: `prefill` is a generator that runs one chunk per
resumption and returns the step's result, so the compute worker can serve other
sessions' decode steps (and releases) between the chunks.

This module imports no torch, so the transport can name the types without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .kv.cache_store import SessionCacheStore
    from .costs import ModelCosts
    from .text.sampling_params import SamplingParams

# Dtype names hidden states may travel in, and their sizes in bytes.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TensorPayload:
    """Hidden states on their way to the next hop."""

    body: bytes
    shape: list[int]
    past_len: int = 0  # tokens the session's caches held before this step
    dtype: str = "bfloat16"
    group: int = 1  # decode steps computed in one batch with this one (the next shard lingers for them)


@dataclass(frozen=True)
class TailTokenResult:
    """What a tail answers: the sampled token. A legacy tail sends text and no token id."""

    text: str
    token_id: int | None
    token_ids: tuple[int, ...] = ()  # after a step with drafts: every token accepted, `token_id` last
    hops: tuple[Any, ...] = ()  # each shard's part of the step (`wire.HopReport`), as the answer brought them
    logprobs: tuple[TokenLogprob, ...] = ()  # asked for (`SamplingParams.logprobs`): one per token, in order
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # after a prefill, asked for: the prompt's 2nd token on


TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]  # (the token's log-probability, (id, logprob) alternatives)


StepResult = TensorPayload | TailTokenResult


@dataclass(frozen=True)
class KVRows:
    """A session's cached keys and values for positions `start ..`, as the cache stores them (`kv_copies`)."""

    start: int  # the first position they hold
    dtype: str  # the cache's kind: float32, bfloat16 or q8_0 (its blocks' bytes)
    shape: tuple[int, int, int, int, int]  # [layers, 2, kv_heads, positions, width]
    body: bytes

    @property
    def count(self) -> int:
        return self.shape[3]


@dataclass(frozen=True)
class DecodeStep:
    """One session's one-token decode step, as handed to `decode_batch`."""

    session_id: str
    token_id: int | None = None  # on the head: the token to embed
    body: bytes | None = None  # on later shards: the hidden state received
    shape: Sequence[int] = ()
    dtype: str = "bfloat16"
    past_len: int | None = None  # None on the head: its own cache says
    sampling: SamplingParams | None = None  # on a tail
    history: Sequence[int] = ()  # token ids so far, when sampling needs them
    generated_from: int | None = None  # where generated tokens start in `history`
    group: int = 1  # on later shards: steps the previous shard computed in one batch with this one


@dataclass(frozen=True)
class PrefillStep:
    """Several positions of one session at once: a (re-)prefill, or a chunk appended at `past_len`."""

    session_id: str | None  # None: stateless, nothing is cached
    token_ids: Sequence[int] | None = None  # on the head: the tokens to embed
    body: bytes | None = None  # on later shards: the hidden states received
    shape: Sequence[int] = ()
    dtype: str = "bfloat16"
    mode: str = "prefill"  # "prefill": the cache starts at 0; "decode": append at past_len
    past_len: int = 0
    sampling: SamplingParams | None = None  # on a tail
    history: Sequence[int] = ()
    generated_from: int | None = None
    drafts: Sequence[int] = ()  # the step's last positions carry these guesses: a tail verifies them

    @property
    def length(self) -> int:
        """How many positions the step carries."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return int(self.shape[1]) if len(self.shape) > 1 else 0


PrefillRun = Generator[None, None, StepResult]  # yields between chunks, returns the step's result


@runtime_checkable
class ShardBackend(Protocol):
    """A layer range `[start, end)` of one model, with a KV cache per session."""

    model_id: str  # the name peers compare in `hello`
    total_layers: int
    start: int
    end: int
    is_head: bool  # holds the tokenizer and the embeddings
    is_tail: bool  # holds the final norm and the LM head, and samples
    context_length: int
    vocab_size: int
    supports_kv_cache: bool
    supports_batching: bool
    hidden_size: int  # width of the hidden states between shards
    weight_bytes: int  # bytes of the weights this shard holds (its layers, not the model)
    compute_facts: dict[str, Any]  # how the layers run: path, dtype and why, threads (for /health)

    def weight_facts(self) -> dict[str, Any]: ...  # its weights: mapped and resident bytes, block types (/health)
    sessions: SessionCacheStore
    tokenizer: Any  # the head's tokenizer (chat template); None elsewhere
    costs: ModelCosts | None  # what each part of the model costs (placement); None: not measured (a test's fake)
    lm_head_seconds: float  # in the LM head and choosing tokens so far (a tail's: placement weighs it apart)

    def prepare_span(self, start: int, end: int) -> Any: ...  # a move's first half: another span loaded beside
    def adopt(self, parts: Any) -> int: ...  # its second half, on the compute thread: serve them (caches dropped)

    def eos_token_ids(self) -> list[int]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def encode_prompt(
        self,
        prompt: str | Sequence[int],
        session_id: str | None = None,
        *,
        sampling: SamplingParams | None = None,
        generated_from: int | None = None,
    ) -> StepResult: ...

    def encode_next_token(
        self,
        token_id: int,
        session_id: str,
        *,
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        generated_from: int | None = None,
        past_len: int | None = None,  # None: the cache's length; else cut back to it first
    ) -> StepResult: ...

    def forward_bytes(
        self,
        body: bytes,
        shape: Sequence[int],
        *,
        dtype: str = "bfloat16",
        session_id: str | None = None,
        cache_mode: str | None = None,
        past_len: int | None = None,
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        generated_from: int | None = None,
    ) -> StepResult: ...

    def prefill(self, step: PrefillStep, chunk_tokens: int) -> PrefillRun: ...

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StepResult | Exception]: ...

    def prefills_together(self, step: PrefillStep) -> bool: ...  # may it join others in `prefill_batch`?

    def prefill_batch(self, steps: Sequence[PrefillStep],  # in one call, and with them `decodes` (one row each)
                      decodes: Sequence[DecodeStep] = ()) -> list[StepResult | Exception]: ...

    def release_session(self, session_id: str) -> bool: ...

    def fork_session(self, parent_id: str, session_id: str, length: int) -> bool: ...


def decode_alone(backend: ShardBackend, step: DecodeStep) -> StepResult:
    """A decode step on the single-session path (what a batch of one runs)."""
    if step.token_id is not None:
        return backend.encode_next_token(step.token_id, step.session_id, sampling=step.sampling,
                                         history=step.history, generated_from=step.generated_from,
                                         past_len=step.past_len)
    return backend.forward_bytes(step.body or b"", step.shape, dtype=step.dtype, session_id=step.session_id,
                                 cache_mode="decode", past_len=step.past_len, sampling=step.sampling,
                                 history=step.history, generated_from=step.generated_from)


def prefill_at_once(backend: ShardBackend, step: PrefillStep) -> PrefillRun:
    """A prefill as one step, for a backend that does not chunk (a generator like `ShardBackend.prefill`)."""
    if step.token_ids is not None:
        if step.mode != "prefill":
            raise ValueError("token ids are prefilled from position 0 only")
        return backend.encode_prompt(list(step.token_ids), step.session_id, sampling=step.sampling,
                                     generated_from=step.generated_from)
    return backend.forward_bytes(step.body or b"", step.shape, dtype=step.dtype, session_id=step.session_id,
                                 cache_mode=step.mode if step.session_id else None, past_len=step.past_len,
                                 sampling=step.sampling, history=step.history, generated_from=step.generated_from)
    yield  # a generator that never pauses


def run_prefill(backend: ShardBackend, step: PrefillStep, chunk_tokens: int) -> StepResult:
    """Every chunk of a prefill at once (where nothing else needs to run in between)."""
    run = backend.prefill(step, chunk_tokens)
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value
