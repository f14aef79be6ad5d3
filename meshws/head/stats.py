"""What a generation is asked for and what it reports: the request, its tokens, its figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..model.backend import TokenLogprob
from ..model.text.sampling_params import SamplingParams
from .drafts import Speculation
from .timing import LapTimes

MAX_GAPS = 65536  # inter-token gaps one generation keeps for /metrics


class FinishReason(str, Enum):
    """Why an answer ended, in the words OpenAI clients expect."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens
    STOPPED = "stopped"  # the client stopped it (/ws/chat)


@dataclass
class GenerationRequest:
    prompt: str  # the prompt as text (templated already)
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_ids: list[int] | None = None  # token ids of the prompt, if already known
    ignore_eos: bool = False  # keep going past EOS until max_tokens (benchmarks)


@dataclass(frozen=True)
class Fork:
    """Another choice of an `n` > 1 request: it starts from the first `length` positions of session `sid`."""

    sid: str
    length: int


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None only from a legacy tail, which sends text instead
    text: str | None = None
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities


@dataclass
class GenerationStats:
    sid: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None  # None while running or if cut short
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    prefills: int = 0
    cache_misses: int = 0
    internal: bool = False  # the head's own (a shared prefix built): no request's, not in the metrics
    failovers: int = 0
    standby_resumes: int = 0  # failovers that resumed on a standby's copy of the session's KV
    recomputed_tokens: int = 0  # positions failovers ran again (all of them, without a standby)
    moves: int = 0  # times it parked while the head moved layers (`rebalance`), then went on, prefilled again
    cached_tokens: int = 0  # prompt tokens a conversation's caches already held
    speculation: Speculation | None = None  # the answer's drafts, when the head guesses
    times: LapTimes = field(default_factory=LapTimes)  # where the laps' time went
    route: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprob]] | None = None  # (token, its logprob) as they come, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # the prompt's, from its first full prefill, if asked
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # between laps that brought tokens (inter-token latency)

    def lap_arrived(self) -> None:
        """A lap brought tokens: the first token's time, or the gap since the last lap's."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None and len(self.token_gaps) < MAX_GAPS:
            self.token_gaps.append(now - self.last_token_at)
        self.last_token_at = now

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def decode_tokens_per_second(self) -> float | None:
        if self.first_token_at is None or self.finished_at is None or self.completion_tokens < 2:
            return None
        span = self.finished_at - self.first_token_at
        return (self.completion_tokens - 1) / span if span > 0 else None
