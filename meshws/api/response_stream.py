"""A streamed /v1/responses answer: OpenAI's typed server-sent events, each with its `sequence_number`.

`response.created` and `response.in_progress` first; the text as `response.output_text.delta`
events inside a message item (`response.output_item.added`, `response.content_part.added`
... `response.output_text.done`, `response.content_part.done`, `response.output_item.done`);
each tool call, whole once the answer is complete, as a function_call item with its
arguments in one `response.function_call_arguments.delta` and `.done`; then
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the answer) with
the whole Response and its usage. A failure is an `error` event, and the stream ends.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from ..head.generation import GenerationStats, PipelineError
from ..head.service import Admission, HeadService
from .answers import pipeline_failure, run_spec
from .errors import ApiError
from .requests import CompletionSpec
from .responses import call_item, ended, message_item, response_object
from .sse import EventStream, SlowClient
from .tools import CallSplitter, calls_in

log = logging.getLogger("meshws.api")


class ResponseEvents:
    """Writes one response's events in order, numbering them."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.message: dict[str, Any] | None = None  # the message item being written
        self.text = ""

    async def send(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        await self.stream.event(data, kind)

    async def text_delta(self, delta: str) -> None:
        """Text of the answer; the message item opens at its first piece."""
        if self.message is None:
            self.message = message_item("", status="in_progress")
            await self.send("response.output_item.added", output_index=len(self.output), item=self.message)
            await self.send("response.content_part.added", item_id=self.message["id"], output_index=len(self.output),
                            content_index=0, part=_part(""))
        self.text += delta
        await self.send("response.output_text.delta", item_id=self.message["id"], output_index=len(self.output),
                        content_index=0, delta=delta, logprobs=[])

    async def close_message(self) -> None:
        if self.message is None:
            return
        where = {"item_id": self.message["id"], "output_index": len(self.output), "content_index": 0}
        await self.send("response.output_text.done", **where, text=self.text, logprobs=[])
        await self.send("response.content_part.done", **where, part=_part(self.text))
        item = dict(message_item(self.text), id=self.message["id"])
        await self.send("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.message = None

    async def call(self, call: dict[str, Any]) -> None:
        item = call_item(call)
        index = len(self.output)
        await self.send("response.output_item.added", output_index=index, item=dict(item, arguments="",
                                                                                    status="in_progress"))
        await self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
        await self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
        await self.send("response.output_item.done", output_index=index, item=item)
        self.output.append(item)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def stream_response(stream: EventStream, spec: CompletionSpec | None, body: dict[str, Any], head: HeadService,
                          admission: Admission | None, stats: GenerationStats, response_id: str = "",
                          created: int = 0, failed: ApiError | None = None) -> web.StreamResponse:
    """The events of one answer (`failed`: an error to tell once the stream has started, and nothing runs)."""
    events = ResponseEvents(stream)
    response_id, created = response_id or "resp_" + uuid.uuid4().hex[:24], created or int(time.time())
    try:
        if failed is not None or spec is None or admission is None:
            error = failed or ApiError(500, "internal error", code="internal_error", kind="server_error")
            await events.send("error", code=error.code, message=error.message, param=error.param)
            return await stream.finish()
        await stream.start()
        await events.send("response.created",
                          response=response_object(body, response_id, created, "in_progress", [], None))
        await events.send("response.in_progress",
                          response=response_object(body, response_id, created, "in_progress", [], None))
        tools = spec.tools if spec.tools is not None and spec.tools.choice != "none" else None
        splitter, parts = CallSplitter(in_call=tools is not None and tools.forced), []
        async with aclosing(run_spec(head, spec, stats, admission)) as deltas:
            async for delta in deltas:
                parts.append(delta)
                content = splitter.feed(delta) if tools is not None else delta
                if content:
                    await events.text_delta(content)
        calls = calls_in("".join(parts), tools)[1] if tools is not None else []
        held = splitter.rest(bool(calls)) if tools is not None else ""
        if held:
            await events.text_delta(held)
        await events.close_message()
        for call in calls:
            await events.call(call)
        status = ended(stats)
        await events.send(f"response.{status}",
                          response=response_object(body, response_id, created, status, events.output, stats))
    except PipelineError as exc:
        error = pipeline_failure(exc)
        await events.send("error", code=error.code, message=error.message, param=None)
    except SlowClient:
        return stream.response  # aborted already
    return await stream.finish()
