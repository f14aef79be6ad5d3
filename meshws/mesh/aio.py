"""Small asyncio helpers: cleanup that a cancellation cannot cut short, and waiting for a condition."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Coroutine


async def until(done: Callable[[], bool], timeout: float) -> bool:
    """Wait until `done()` (polled every 50 ms) or `timeout` seconds; whether it came true."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def run_uncancelled(coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run `coroutine` to its end even if the caller is cancelled meanwhile, then re-raise that.

    aiohttp cancels a handler when its client disconnects, possibly while the
    handler's `finally` is releasing sessions; a release cut short would leak a
    KV cache until its TTL.
    """
    task = asyncio.ensure_future(coroutine)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()
