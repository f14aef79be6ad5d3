"""A small asyncio helper: cleanup that a cancellation cannot cut short."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine


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
