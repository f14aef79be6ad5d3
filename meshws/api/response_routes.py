"""The /v1/responses route: a Responses request checked, admitted and run, its answer whole or streamed."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing

from aiohttp import web

from ..head.generation import GenerationStats, PipelineError
from ..head.service import HeadService, Unavailable
from .answers import pipeline_failure, run_spec, unavailable
from .errors import ApiError, json_response, read_json
from .requests import check_request, complete_spec
from .response_stream import stream_response
from .responses import as_chat, ended, output_items, response_object
from .sse import EventStream


class ResponsesApi:
    def __init__(self, head: HeadService, write_timeout: float = 30.0, sse_ping: float = 15.0) -> None:
        self.head = head
        self.write_timeout = write_timeout
        self.sse_ping = sse_ping

    async def create(self, request: web.Request) -> web.StreamResponse:
        stats = GenerationStats(sid=uuid.uuid4().hex)
        try:
            body = await read_json(request)
            draft = check_request(as_chat(body), True, self.head)
        except ApiError as exc:
            return exc.response()
        stream = EventStream(request, self.sse_ping, self.write_timeout) if draft.body.get("stream") else None
        try:
            admission = await (stream.waiting(self.head.admit()) if stream is not None else self.head.admit())
        except Unavailable as exc:
            return unavailable(exc).response() if stream is None or not stream.open else \
                await stream_response(stream, None, body, self.head, None, stats, failed=unavailable(exc))
        response_id, created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        try:
            spec = await complete_spec(draft, self.head)
            spec.owner = f"{request.remote}\n{body.get('user')}"  # a warm session serves its owner only
            if stream is not None:
                return await stream_response(stream, spec, body, self.head, admission, stats, response_id, created)
            parts: list[str] = []
            async with aclosing(run_spec(self.head, spec, stats, admission)) as deltas:
                async for delta in deltas:
                    parts.append(delta)
        except ApiError as exc:
            return exc.response() if stream is None or not stream.open else \
                await stream_response(stream, None, body, self.head, None, stats, failed=exc)
        except PipelineError as exc:
            return pipeline_failure(exc).response()
        finally:
            admission.release()
            if stream is not None:
                stream.stop_pings()
        output = output_items("".join(parts), spec)
        return json_response(response_object(body, response_id, created, ended(stats), output, stats))
