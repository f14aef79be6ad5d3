"""Where transport meets compute: model calls run on one worker thread, off the event loop.

Every shard call (prefill, decode, release) goes through `ComputeWorker.call`, so
websockets, heartbeats and other sessions stay responsive while a step runs,
and steps of different sessions interleave one at a time.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ComputeWorker:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshws-compute")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
