"""Choosing the next token from the tail's logits, with per-session parameters.

A seeded session draws its randomness from (seed, position) alone, so a step
replayed after a cache miss or a failover samples the same token again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch


GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    repetition_penalty: float = 1.0  # HF-style: divides positive logits of seen tokens
    frequency_penalty: float = 0.0  # OpenAI-style: minus count x penalty for generated tokens
    presence_penalty: float = 0.0  # OpenAI-style: minus penalty for tokens generated at least once
    seed: int | None = None  # makes sampled output reproducible
    logprobs: int | None = None  # report each token's log-probability and this many likeliest alternatives
    prompt_logprobs: bool = False  # ... and, from a prefill, each prompt token's (completions' `echo`)
    grammar: str | None = None  # an llguidance grammar the answer must follow (structured output)

    @property
    def greedy(self) -> bool:
        """Argmax below GREEDY_BELOW, as vLLM (logits over a temperature of 1e-38 overflow to infinities, whose
        softmax is NaN: sampling would fail where its limit is the greedy choice)."""
        return self.temperature < GREEDY_BELOW

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the tokens so far (the head then sends them)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.prompt_logprobs  # the tail reads each prompt token's log-probability
            or self.grammar is not None  # the grammar's state is the tokens generated so far
        )

    def to_wire(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value != getattr(DEFAULT, key)}

    @classmethod
    def from_wire(cls, data: Any) -> "SamplingParams":
        """Validate sampling settings received from a peer; ValueError names the bad field."""
        if data is None:
            return DEFAULT
        if not isinstance(data, dict):
            raise ValueError("sampling must be an object")
        fields: dict[str, Any] = {}
        for key, value in data.items():
            if key not in _FIELD_TYPES:
                raise ValueError(f"unknown sampling field {key!r}")
            kind = _FIELD_TYPES[key]
            if value is None and key in ("seed", "logprobs", "grammar"):
                continue
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"sampling field {key!r} must be true or false")
            if kind is str and (not isinstance(value, str) or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"sampling field {key!r} must be a string of at most {MAX_GRAMMAR_CHARS} characters")
            if kind not in (bool, str) and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(f"sampling field {key!r} must be a number")
            fields[key] = value
        params = cls(**fields)
        params.validate()
        return params

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be between -2 and 2")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be between -2 and 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs and (self.logprobs is None or self.logprobs > MAX_PROMPT_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs needs logprobs between 0 and {MAX_PROMPT_TOP_LOGPROBS}")


DEFAULT = SamplingParams()
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "repetition_penalty": (int, float),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "seed": int,
    "logprobs": int,
    "prompt_logprobs": bool,
    "grammar": str,
}
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound)
MAX_PROMPT_TOP_LOGPROBS = 5  # alternatives per prompt token (OpenAI's completions bound; keeps the answer small)
MAX_PROMPT_LOGPROBS = 4096  # prompt tokens whose log-probabilities one answer carries
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are held at once (256 x 49,152 floats: 48 MiB)


def greedy_choice(logits: torch.Tensor) -> int:
    """torch.argmax's choice (the first largest value; a NaN counts as largest) by numpy's vectorised argmax on
    float32, which bf16 widens to exactly: torch's own took 204 us for a row of 49,152 bf16 logits, this 12 us,
    and a tail chooses a token per row of every step."""
    return int(logits.detach().float().numpy().argmax())


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    history: Sequence[int] = (),
    generated_from: int | None = None,
    constraint: Any = None,
) -> int:
    """Pick a token id from one row of logits.

    `position` is the index the new token will take in the sequence; `history`
    holds the ids so far (needed only for penalties); tokens from index
    `generated_from` on count as generated for the OpenAI-style penalties. A
    `constraint` (a grammar's `constraints.Matcher`) masks the row first, in place, and
    advances by the token chosen.
    """
    if constraint is not None:
        constraint.mask_(logits)
        token = sample_token(logits, params, position, history, generated_from)
        constraint.advance(token)
        return token
    if params.needs_history and history:
        logits = _apply_penalties(logits.float(), params, history, generated_from)
    if params.greedy:
        return greedy_choice(logits)
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_drafts(
    logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    drafts: Sequence[int],
    history: Sequence[int] = (),
    generated_from: int | None = None,
    constraint: Any = None,
) -> list[int]:
    """The tokens a step with drafts yields: the longest agreeing prefix of `drafts`, plus one of our own.

    `logits` has a row per position of the step's last `len(drafts) + 1` positions; the
    first row chooses the token at `position`. Each position is sampled exactly as a
    one-token step would sample it (same random stream per (seed, position), penalties
    over the tokens before it); a draft is kept only if it is that choice. So the
    tokens are those of decoding one by one, whatever the drafts were.
    """
    accepted: list[int] = []
    for index in range(len(drafts) + 1):
        before = [*history, *accepted] if params.needs_history else history
        token = sample_token(logits[index], params, position + index, before, generated_from, constraint)
        accepted.append(token)
        if index == len(drafts) or token != drafts[index]:
            break
    return accepted


def token_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    tokens: Sequence[int],
    history: Sequence[int] = (),
    generated_from: int | None = None,
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Each chosen token's log-probability and the `params.logprobs` likeliest alternatives (row i of `logits`
    chose `tokens[i]`).

    The distribution is the sampler's: penalties over the tokens before, then the
    temperature (greedy decoding reports temperature 1, the model's own distribution),
    before top-k and top-p cut it, as OpenAI and vLLM report them.
    """
    reported = []
    for index, token in enumerate(tokens):
        row = logits[index].float()
        before = [*history, *tokens[:index]] if params.needs_history else ()
        if before:
            row = _apply_penalties(row, params, before, generated_from)
        if not params.greedy:
            row = row / params.temperature
        logp = torch.log_softmax(row, dim=-1)
        top = torch.topk(logp, params.logprobs) if params.logprobs else None
        alternatives = tuple((token_id, value) for token_id, value in zip(top.indices.tolist(), top.values.tolist())
                             if value > float("-inf")) if top is not None else ()  # (a grammar masks tokens)
        reported.append((float(logp[int(token)]), alternatives))
    return reported


def prompt_token_logprobs(logits_of: Callable[[torch.Tensor, int], torch.Tensor], hidden: torch.Tensor, start: int,
                          params: SamplingParams | None, history: Sequence[int],
                          prompt_length: int | None) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """If `params` ask for them: each prompt token's log-probability under the model (temperature 1, no
    penalties: a prompt is not sampled) and the likeliest alternatives, from the positions `start...` of
    `hidden` (position j predicts token j + 1; the first prompt token has none). `logits_of(hidden, rows)`:
    the LM head."""
    end = min(start + hidden.shape[1], (prompt_length or len(history)) - 1, MAX_PROMPT_LOGPROBS, len(history) - 1)
    if params is None or not params.prompt_logprobs or end <= start:
        return []
    top, reported = params.logprobs or 0, []
    for first in range(start, end, PROMPT_LOGPROB_ROWS):  # a block of rows at a time: vocab-wide rows are large
        last = min(end, first + PROMPT_LOGPROB_ROWS)
        following = torch.tensor(list(history[first + 1 : last + 1]), dtype=torch.long).unsqueeze(1)
        logp = torch.log_softmax(logits_of(hidden[:, first - start : last - start], last - first).float(), dim=-1)
        chosen = logp.gather(1, following)[:, 0].tolist()
        if not top:
            reported += [(value, ()) for value in chosen]
            continue
        best = torch.topk(logp, top, dim=-1)
        reported += [(value, tuple(zip(ids, values)))
                     for value, ids, values in zip(chosen, best.indices.tolist(), best.values.tolist())]
    return reported


def _apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    generated_from: int | None,
) -> torch.Tensor:
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    generated = history[generated_from:] if generated_from is not None else ()
    if generated and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.tensor(list(generated), dtype=torch.long).unique(return_counts=True)
        logits[ids] -= counts.to(logits.dtype) * params.frequency_penalty + params.presence_penalty
    return logits
