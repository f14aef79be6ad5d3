"""Choosing the next token from the tail's logits, with per-session parameters.

A seeded session draws its randomness from (seed, position) alone, so a step
replayed after a cache miss or a failover samples the same token again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .sampling_params import MAX_PROMPT_LOGPROBS, SamplingParams


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
