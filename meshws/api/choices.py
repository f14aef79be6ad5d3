"""`n` > 1: several choices of one request, the prompt prefilled once.

The first choice runs as any request does; once its prompt is in the caches of its route
(its first lap), the others start on the same route from a copy of those caches (`fork`
in `open`: every shard copies the first choice's positions but the last, so each choice
runs only the prompt's last token and then its own answer). A seeded request's choice
i samples with seed + i, so the choices differ and each is reproducible; greedy choices
are identical. The request's admission (its slot) is held until every choice has ended.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from ..head.generation import GenerationRequest, GenerationStats
from ..head.service import Admission, ChoiceOf, HeadService
from ..head.stats import Fork
from .requests import CompletionSpec


@dataclass
class Choice:
    stats: GenerationStats
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def run_choices(head: HeadService, spec: CompletionSpec, admission: Admission, first: GenerationStats,
                      on_delta: Callable[[int, str], Awaitable[None]] | None = None) -> list[Choice]:
    """Every choice's text and figures; `on_delta(index, text)` as each comes (streams)."""
    prefilled = asyncio.Event()
    choices = [Choice(first)] + [Choice(GenerationStats(sid=uuid.uuid4().hex, started=first.started))
                                 for _ in range(spec.n - 1)]
    for choice in choices[1:]:
        choice.stats.logprobs = [] if first.logprobs is not None else None
    prompt_length = len(spec.prompt_ids)

    async def one(index: int) -> None:
        choice = choices[index]
        if index:
            await prefilled.wait()
        where = ChoiceOf(prefilled=prefilled) if index == 0 else \
            ChoiceOf(fork=Fork(first.sid, prompt_length - 1) if prompt_length > 1 else None)
        seed = spec.sampling.seed
        sampling = spec.sampling if index == 0 or seed is None else replace(spec.sampling, seed=seed + index)
        request = GenerationRequest(prompt=spec.prompt, max_tokens=spec.max_tokens, sampling=sampling,
                                    prompt_ids=spec.prompt_ids, ignore_eos=spec.ignore_eos)
        async with aclosing(head.stream(request, spec.stop, choice.stats, admission, choice.token_ids,
                                        choice=where)) as deltas:
            async for delta in deltas:
                choice.parts.append(delta)
                if on_delta is not None:
                    await on_delta(index, delta)

    tasks = [asyncio.create_task(one(index)) for index in range(spec.n)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return choices
