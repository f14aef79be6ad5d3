"""What every endpoint's answer is made of: the token counts, the errors of a failed mesh or a full head,
and running a validated request's generation.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from aiohttp import web

from ..head.conversation import Conversation
from ..head.generation import GenerationRequest, GenerationStats, PipelineError
from ..head.service import Admission, HeadService, Unavailable
from .choices import Choice
from .errors import ApiError, public_text
from .requests import CompletionSpec
from .sse import EventStream, SlowClient


def unavailable(exc: Unavailable) -> ApiError:
    """503 with Retry-After: the head has no room or no route now."""
    return ApiError(503, public_text(str(exc)), code=exc.code, kind="service_unavailable",
                    headers={"Retry-After": str(exc.retry_after)})


def pipeline_failure(exc: PipelineError) -> ApiError:
    """The mesh failed: a 502, or the same error as a stream's last event."""
    return ApiError(502, f"pipeline error: {public_text(str(exc))}", code="pipeline_error", kind="upstream_error")


def usage(stats: GenerationStats, choices: Sequence[Choice] = ()) -> dict[str, Any]:
    """The answer's token counts (`choices`: all of an `n` > 1 request's; the prompt counts once)."""
    completion = sum(choice.stats.completion_tokens for choice in choices) if choices else stats.completion_tokens
    counts: dict[str, Any] = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # not prefilled again: a kept session's
    }
    if stats.speculation is not None and stats.speculation.laps:  # an extension: how the drafts fared
        counts["speculation"] = stats.speculation.describe()
    return counts


def run_spec(head: HeadService, spec: CompletionSpec, stats: GenerationStats, admission: Admission,
             token_ids: list[int] | None = None, conversation: Conversation | None = None) -> AsyncIterator[str]:
    """The text of a validated, admitted request as it is decided (close it with `aclosing`)."""
    request = GenerationRequest(prompt=spec.prompt, max_tokens=spec.max_tokens, sampling=spec.sampling,
                                prompt_ids=spec.prompt_ids, ignore_eos=spec.ignore_eos)
    return head.stream(request, spec.stop, stats, admission, token_ids, conversation,
                       owner=spec.owner if spec.cache_prompt else None,
                       prefix_key=spec.cache_salt if spec.cache_prompt else None)


def finish_reason(stats: GenerationStats) -> str:
    return stats.finish_reason.value if stats.finish_reason else "length"


async def stream_error(stream: EventStream, error: dict[str, Any]) -> web.StreamResponse:
    """An error after the stream started (the status line is sent): an error event, then [DONE]."""
    try:
        await stream.event(error)
        await stream.done()
        return await stream.finish()
    except (SlowClient, ConnectionError):
        return stream.response
