"""Several prompts in one POST /v1/completions (a list of strings or of token-id lists), as OpenAI takes them.

Each prompt is a request of its own: its own session and its own slot of `--max-generations`.
The first prompt runs under the request's admission; each other one waits in the admission
queue like any request (in order, so a batch neither jumps the queue nor holds more slots
than the head has), and starts as soon as it is admitted: prompts run at once as slots
allow. Every prompt is tokenized and checked before any runs, so a bad one refuses the whole
request. The answer lists every choice with `index` = prompt index x `n` + choice, as OpenAI
numbers them, each with its own echo and log-probabilities; `usage` sums the prompts. A
stream carries each choice's text as it comes, its chunks naming their index.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..head.generation import GenerationStats, PipelineError
from ..head.service import Admission, HeadService, Unavailable
from .answers import finish_reason, pipeline_failure, stream_error, unavailable, usage
from .choices import Choice, run_choices
from .chunks import Chunks
from .errors import ApiError, json_response
from .requests import BATCH_CONTEXTS, CompletionSpec, RequestDraft, batch_tokens, complete_spec
from .sse import EventStream, SlowClient

ShapeChoice = Callable[[CompletionSpec, bool, Choice, int, GenerationStats], dict[str, Any]]
OnDelta = Callable[[int, str], Awaitable[None]]


@dataclass
class PromptRun:
    """One prompt of a batch: its spec, its first choice's figures, and its choices once they end."""

    spec: CompletionSpec
    stats: GenerationStats
    choices: list[Choice] = field(default_factory=list)


async def prepared(draft: RequestDraft, head: HeadService) -> list[PromptRun]:
    """Every prompt tokenized and checked (ApiError names the first bad one), before any runs."""
    runs = []
    for index, (text, ids) in enumerate(draft.batch):
        try:
            spec = await complete_spec(replace(draft, prompt=text, prompt_ids=ids, batch=[]), head)
        except ApiError as exc:
            raise ApiError(exc.status, f"prompt {index}: {exc.message}", param=exc.param, code=exc.code) from None
        stats = GenerationStats(sid=uuid.uuid4().hex)
        stats.logprobs = [] if draft.sampling.logprobs is not None else None
        runs.append(PromptRun(spec, stats))
    if sum(len(run.spec.prompt_ids) for run in runs) > batch_tokens(head):
        raise ApiError(400, f"the prompts together hold more than {BATCH_CONTEXTS} context windows of tokens",
                       param="prompt", code="context_length_exceeded")
    return runs


async def run_batch(head: HeadService, runs: list[PromptRun], admission: Admission,
                    on_delta: OnDelta | None = None) -> None:
    """Every prompt's choices: each prompt admitted in turn (the first under `admission`) and run at once."""
    n = runs[0].spec.n

    async def one(index: int, run: PromptRun, mine: Admission, extra: list[Any]) -> None:
        try:
            tell = None if on_delta is None else lambda choice, delta: on_delta(index * n + choice, delta)
            run.choices = await run_choices(head, run.spec, mine, run.stats, tell)
        finally:
            mine.release()
            for slot in extra:
                slot.release()

    tasks: list[asyncio.Task] = []
    try:
        for index, run in enumerate(runs):
            failed = next((task for task in tasks if task.done() and task.exception()), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            mine = admission if index == 0 else await head.admit()
            extra = head.queue.take_now(n - 1) if n > 1 else []  # in turn: none of this batch waits meanwhile
            if extra is None:
                mine.release()
                raise Unavailable(f"{n} choices need {n} free generation slots; retry shortly", "queue_full", 1)
            tasks.append(asyncio.create_task(one(index, run, mine, extra)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(runs: list[PromptRun]) -> dict[str, Any]:
    """Every prompt's token counts added up."""
    counts = [usage(run.stats, run.choices) for run in runs]
    total = {key: sum(count[key] for count in counts) for key in ("prompt_tokens", "completion_tokens",
                                                                  "total_tokens")}
    cached = sum(count["prompt_tokens_details"]["cached_tokens"] for count in counts)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


async def serve_batch(head: HeadService, draft: RequestDraft, admission: Admission, stream: EventStream | None,
                      shape: ShapeChoice) -> web.StreamResponse:
    """A batch's answer, whole or streamed; its errors as the endpoint shapes them."""
    chunks = Chunks("cmpl-" + uuid.uuid4().hex[:24], chat=False, model=draft.body["model"])

    try:
        runs = await prepared(draft, head)
        if stream is None:
            await run_batch(head, runs, admission)
            n = runs[0].spec.n
            choices = [shape(run.spec, False, choice, index * n + j, run.stats)
                       for index, run in enumerate(runs) for j, choice in enumerate(run.choices)]
            extra = {"prompt_token_ids": [run.spec.prompt_ids for run in runs]} if runs[0].spec.return_token_ids \
                else {}
            return json_response(chunks.frame(choices, usage=summed_usage(runs), system_fingerprint=None, **extra))
        return await _streamed(head, runs, admission, stream, chunks)
    except (ApiError, Unavailable, PipelineError) as exc:
        error = exc if isinstance(exc, ApiError) else \
            unavailable(exc) if isinstance(exc, Unavailable) else pipeline_failure(exc)
        if stream is None or not stream.open:
            return error.response()
        return await stream_error(stream, error.body())


async def _streamed(head: HeadService, runs: list[PromptRun], admission: Admission, stream: EventStream,
                    chunks: Chunks) -> web.StreamResponse:
    try:
        await stream.start()
        await run_batch(head, runs, admission, lambda index, delta: stream.event(chunks.one(index, delta)))
        n = runs[0].spec.n
        for index, run in enumerate(runs):
            for j, choice in enumerate(run.choices):
                await stream.event(chunks.one(index * n + j, None, finish_reason(choice.stats)))
        if runs[0].spec.include_usage:
            await stream.event(chunks.frame([], usage=summed_usage(runs)))
        await stream.done()
        return await stream.finish()
    except SlowClient:
        return stream.response  # aborted already
