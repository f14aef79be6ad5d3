"""A TCP relay that delays every byte by a fixed time each way: a long link on one machine.

`tc netem` is not available everywhere; this stands in for it in the benchmark and
the tests. Each connection to the relay is piped to `target`; what arrives from the
client is delivered `delay` seconds later, what comes back `delay_back` seconds later
(the same unless given), in order (a link's latency, not its bandwidth).
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class DelayRelay:
    def __init__(self, target_host: str, target_port: int, delay: float, delay_back: float | None = None) -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self.delay_back = delay if delay_back is None else delay_back
        self.port = 0
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1") -> int:
        self._server = await asyncio.start_server(self._serve, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer, self.delay),
                                 self._pipe(up_reader, writer, self.delay_back))
        finally:
            for side in (writer, up_writer):
                side.close()
            if task is not None:
                self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        """Copy `reader` to `writer`, each chunk `delay` seconds after it arrived."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((time.monotonic() + delay, data))
                if not data:
                    break
            await sender
        except (ConnectionError, asyncio.CancelledError):
            sender.cancel()
            raise
        finally:
            if not sender.done():
                sender.cancel()


class RelayThread:
    """A `DelayRelay` on its own event loop thread, for code that is not async (the benchmark)."""

    def __init__(self, target_port: int, delay: float, target_host: str = "127.0.0.1",
                 delay_back: float | None = None) -> None:
        import threading

        self.relay = DelayRelay(target_host, target_port, delay, delay_back)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.relay.start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
