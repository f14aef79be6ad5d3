"""Small asyncio helpers: cleanup that a cancellation cannot cut short, waiting for a condition, and whether a
dial found no way to its peer."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Coroutine

import aiohttp


async def waited(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for `event` at most `timeout` seconds (None: for as long as it takes); whether it was set."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


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


def no_way_to(exc: BaseException) -> bool:
    """Did a dial find no way to the peer (timed out, no route), as dials to a node behind NAT do? A refused
    connection is not that: the peer's host answered, and nothing listens (the node is down or restarting)."""
    if isinstance(exc, aiohttp.ClientSSLError):  # (reached, and its TLS is wrong: not a NAT, and said so)
        return False
    if isinstance(exc, aiohttp.ClientConnectorError):
        return not isinstance(exc.os_error, ConnectionRefusedError)
    return isinstance(exc, (aiohttp.ConnectionTimeoutError, asyncio.TimeoutError))
