"""Where transport meets compute: model calls run on one worker thread, off the event loop.

Every shard call goes through the worker, so websockets, heartbeats and other sessions stay responsive while a step
runs. Decode steps are batched: when the worker turns to decode work it takes every decode step waiting at that
moment (different sessions, different past lengths) and runs them as one `decode_batch`. Nothing waits for a batch
to fill: a lone session's step runs as soon as the worker is free, on the single-session path. Other work alternates
with decode batches, so neither starves the other; a long prefill is such work one chunk at a time (`prefill`: after
each chunk it goes to the back of the queue), so it delays other sessions' decode steps by one chunk at most. New
sessions' prompts queued together that the backend can run in one call (`prefills_together`, up to a chunk's tokens
in all) run as one `prefill_batch`: on a shard bound by reading its weights, sixteen sessions joining at once no
longer read them sixteen times (on a GGUF's blocks they share a layout of the tiles). A prompt longer than a chunk
never joins. A decode batch takes such prompts along too (in one call; not right after a call that ran prompts, so a
step waits one chunk at most), and the running sessions' steps neither read the weights apart nor wait a prompt's
turn. Releases jump every queue: they wait for the chunk or batch running, never for queued work. A job whose caller
has gone (its future cancelled) is skipped, chunks included. A batch that raises is retried row by row, so only the
failing row gets the error; a call of prompts that raises runs its steps in a batch, then each prompt alone. Which
decode steps a batch takes and how long it waits for them (groups in flight, or one wave kept whole where nodes
share a host's cores): `waves`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, TypeVar

from ..model.backend import DecodeStep, PrefillStep, ShardBackend, StepResult, TensorPayload, decode_alone
from .waves import InFlight, Waves

T = TypeVar("T")
IDLE_RETUNE_SECONDS = 3.0  # an idle worker with `retune` still calls it this often
MAX_BATCH = 64
PREFILL_CHUNK = 256  # tokens of a prefill run between two turns of other work


@dataclass
class _Job:
    run: Callable[[], Any] | None  # other work
    step: DecodeStep | None  # or a decode step
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    chunks: Generator[None, None, Any] | None = None  # or a chunked prefill, resumed once per turn
    prefill: PrefillStep | None = None  # (that prefill's step: new sessions' prompts may run together)
    started: bool = False  # a chunk of it has run (or it failed beside others: never tried together again)
    queued: float = 0.0  # when it came (`waves`: how long a wave's part that is back waits for the rest)


class ComputeWorker(Waves):
    def __init__(self, backend: ShardBackend, max_batch: int = MAX_BATCH,
                 live_sessions: Callable[[], int] = lambda: 1, prefill_chunk: int = PREFILL_CHUNK,
                 retune: Callable[[], None] | None = None, micro_batches: Callable[[], int] = lambda: 1,
                 rest: Callable[[], None] | None = None, whole_wave: Callable[[], bool] = lambda: False,
                 timed: Callable[[float, float], None] | None = None) -> None:
        self.backend = backend
        self.timed = timed  # told each lone decode step's seconds, and its LM head's (the node's speed: `model.speed`)
        self.max_batch = max_batch
        self.prefill_chunk = max(1, prefill_chunk)
        # How many sessions could send a decode step soon. The steps of one round arrive microseconds apart: with
        # several sessions live, lingering a few ms for them turns 1 + 15 into one batch of 16 (one alone never waits).
        self.live_sessions = live_sessions
        self.retune = retune  # called on this thread before a job computes: follow the host's core share (`cores`)
        self.rest = rest  # and this once it no longer computes, before its first result goes out (`_mark`)
        # Groups the live sessions' decode steps are split into (on a head: the shards on its route), so
        # that while the next shard computes one group this one computes the next: several waves in flight.
        self.micro_batches = micro_batches
        self.whole_wave = whole_wave  # or (a head whose host's nodes lend each other cores) one wave, kept whole
        self._in_flight = InFlight()  # (`waves`) sessions whose step this shard sent on, not yet back
        self.lingers = 0  # decode batches that waited for more steps (never for a lone session)
        self._computing = False  # what this node last said (`_mark`)
        self._arrived = 0.0  # when the last decode step was queued
        self.busy_seconds = 0.0  # time spent computing (idle = waiting on the network or on nothing)
        self.recent: deque[tuple[float, float, int]] = deque(maxlen=128)  # (start, end, rows) of recent jobs
        self.batches, self.batched_steps = 0, 0  # decode batches of two or more steps run so far, and their steps
        self.chunks = self.prefill_batches = self.rides = 0  # prefill chunks; calls of several prompts (rides: +steps)
        self._carried = False  # the last call ran a prompt's tokens: the next decode batch takes none along
        self._urgent: deque[_Job] = deque()
        self._decodes: deque[_Job] = deque()
        self._others: deque[_Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="meshws-compute", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:  # `fn` on the worker thread
        return await self._submit(_Job(functools.partial(fn, *args, **kwargs), None, *self._future()))

    async def decode(self, step: DecodeStep) -> StepResult:  # batched with the steps waiting at the same time
        return await self.decode_now(step)

    def decode_now(self, step: DecodeStep) -> asyncio.Future:
        """`decode`, queued at once rather than when awaited: its result's future (cancel it: the step is skipped)."""
        return self._enqueue(_Job(None, step, *self._future()))

    async def prefill(self, step: PrefillStep) -> StepResult:  # in chunks of `prefill_chunk` tokens, between work
        return await self.prefill_now(step)

    def prefill_now(self, step: PrefillStep) -> asyncio.Future:
        """`prefill`, queued at once: its result's future."""
        return self._enqueue(_Job(None, None, *self._future(), chunks=self.backend.prefill(step, self.prefill_chunk),
                                  prefill=step))

    async def urgent(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the worker before any queued work (after the chunk or batch now running)."""
        return await self._submit(_Job(functools.partial(fn, *args, **kwargs), None, *self._future()), urgent=True)

    async def release(self, session_id: str) -> bool:
        """Drop a session's caches, ahead of queued work: a release never waits behind prefills."""
        self.returned(session_id)
        return await self.urgent(self.backend.release_session, session_id)

    def returned(self, session_id: str) -> None:
        """`session_id`'s step is back from the later shards (or failed there, or its answer ended): a wave no
        longer waits for it, whenever its next step comes (a client slow to read delays its own, not the wave)."""
        with self._ready:
            self._in_flight.back(session_id)
            self._ready.notify()

    def counts(self) -> dict[str, int]:  # what the worker has run so far, by kind (`/health`)
        return {"decode_batches": self.batches, "batched_steps": self.batched_steps, "prefill_chunks": self.chunks,
                "prefill_batches": self.prefill_batches, "rides": self.rides, "lingers": self.lingers}

    @property
    def queued(self) -> int:  # jobs waiting (not the one running)
        with self._ready:
            return len(self._urgent) + len(self._decodes) + len(self._others)

    def shutdown(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=30)

    def _future(self) -> tuple[asyncio.Future, asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        return loop.create_future(), loop

    async def _submit(self, job: _Job, urgent: bool = False) -> Any:
        return await self._enqueue(job, urgent)

    def _enqueue(self, job: _Job, urgent: bool = False) -> asyncio.Future:
        with self._ready:
            if self._closed:
                if job.chunks is not None:
                    job.chunks.close()
                raise RuntimeError("the compute worker is shut down")
            queue = self._urgent if urgent else self._decodes if job.step is not None else self._others
            job.queued = time.monotonic()
            queue.append(job)
            self._in_flight.back(job.step.session_id if job.step else job.prefill.session_id if job.prefill else None)
            if job.step is not None:
                self._arrived = time.monotonic()
            self._ready.notify()
        return job.future

    def _serve(self) -> None:
        other_turn = False
        while True:
            together: list[_Job] = []
            with self._ready:
                while not (self._urgent or self._decodes or self._others or self._closed):
                    if not self._ready.wait(IDLE_RETUNE_SECONDS if self.retune else None):
                        self._hint(self.retune)  # idle a while: follow the core share all the same
                        self._hint(self.rest)
                if self._closed and not (self._urgent or self._decodes or self._others):
                    return
                if self._urgent:
                    batch, job = [], self._urgent.popleft()
                elif self._decodes and not (other_turn and self._others) and not (self._others and self._wave_out()):
                    group, split = self._group_size()
                    if self._wave_kept():
                        self._hold_wave()
                        if self._others and self._wave_out():
                            continue  # other work came while the wave is out: it runs now, never splitting the wave
                    else:
                        self._linger(*((group,) if split else self._wave(group)))
                    batch, job, other_turn = self._take(group, split), None, True
                    together = [] if self._carried else self._together(None, 1)  # (a step waits a chunk at most)
                else:
                    batch, job = [], self._others.popleft()
                    ride = bool(self._decodes) and not self._wave_out()  # (a wave's part waits for the rest of it)
                    together = self._together(job, 1 if ride else 2)
                    if together and ride:  # the decode steps waiting go along, in the prompts' call
                        batch = self._take(*self._group_size())
                    other_turn = False
            self._carried = bool(together) or (job is not None and job.prefill is not None)
            batch = [waiting for waiting in batch if not waiting.future.done()]  # callers gone: no work for them
            if job is not None and job.future.done() and not together:
                if job.chunks is not None:
                    job.chunks.close()
                continue
            if job is None and not batch and not together:
                continue
            self._mark(True)
            started = time.monotonic()
            if together:
                self._run_prefills(together, batch)
            elif job is not None and job.chunks is not None:
                self._run_chunk(job)
            elif job is not None:
                self._run_one(job, job.run)  # type: ignore[arg-type]
            else:
                self._run_decodes(batch)
            ended = time.monotonic()
            self._mark(False)
            self.busy_seconds += ended - started
            self.recent.append((started, ended, len(batch)))

    @staticmethod
    def _hint(call: Callable[[], None] | None) -> None:
        try:
            call() if call is not None else None
        except Exception:  # a tuning hint: never a reason for the worker to stop
            pass

    def _together(self, first: _Job | None, least: int) -> list[_Job]:
        """(Lock held.) `first` (else: beside a decode batch) and the new sessions' prompts queued behind it that
        may share its call (`prefills_together`), `prefill_chunk` tokens at most, taken off the queue: or none,
        if fewer than `least`."""
        try:
            lead = None if first is None else first.prefill
            if first is not None and (lead is None or first.started or lead.length > self.prefill_chunk
                                      or not self.backend.prefills_together(lead)):
                return []
            found, tokens = ([], 0) if first is None or lead is None else ([first], lead.length)
            for job in list(self._others):
                step = job.prefill
                if step is not None and not job.started and not job.future.done() \
                        and tokens + step.length <= self.prefill_chunk and self.backend.prefills_together(step):
                    found.append(job)
                    tokens += step.length
        except Exception:  # a hint: each prefill runs on its own then
            return []
        if len(found) < least:
            return []
        for job in found[1 if first is not None else 0 :]:
            self._others.remove(job)
        return found

    def _run_prefills(self, jobs: list[_Job], decodes: list[_Job] | None = None) -> None:
        """New sessions' prefills in one call, with `decodes`' steps if any; if the call fails, the steps run in a
        batch and each prompt later on its own (only a step at fault fails)."""
        for job in [job for job in jobs if job.future.done()]:  # callers gone: no work for them
            jobs.remove(job)
            if job.chunks is not None:
                job.chunks.close()
        decodes = decodes or []
        if len(jobs) < (1 if decodes else 2):
            for job in jobs:
                self._run_chunk(job)
            self._run_decodes(decodes)
            return
        try:
            steps = [job.prefill for job in jobs]
            results: list[Any] = self.backend.prefill_batch(steps, [job.step for job in decodes]) if decodes \
                else self.backend.prefill_batch(steps)  # type: ignore[arg-type]
        except Exception:  # the steps now (they waited one call), then each prompt alone in its own turn
            with self._ready:
                for job in reversed(jobs):
                    job.started = True  # (never tried together again: a prompt at fault fails alone)
                    self._others.appendleft(job)
            self._run_decodes(decodes)
            return
        self.prefill_batches += 1
        self.rides += 1 if decodes else 0
        for job, result in zip(jobs, results):
            if job.chunks is not None:
                job.chunks.close()
            self._deliver((job, result))
        self._delivered(decodes, results[len(jobs):])

    def _run_decodes(self, batch: list[_Job]) -> None:
        self._mark(True)
        if len(batch) == 1:  # (delivered as a batch's: a wave's part that ran alone is on its way too)
            self._delivered(batch, [self._alone(batch[0])])
        elif batch:
            self._run_batch(batch)

    def _run_one(self, job: _Job, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as exc:  # delivered to the caller, never lost in the thread
            self._deliver((job, exc))
        else:
            self._deliver((job, result))

    def _run_chunk(self, job: _Job) -> None:
        """One chunk of a prefill; then back to the end of the queue, or its result delivered."""
        assert job.chunks is not None
        self._mark(True)
        job.started = True
        try:
            next(job.chunks)
        except StopIteration as done:
            self._deliver((job, done.value))
            return
        except BaseException as exc:
            self._deliver((job, exc))
            return
        finally:
            self.chunks += 1
        with self._ready:
            self._others.append(job)

    def _run_batch(self, batch: list[_Job]) -> None:
        try:
            results: list[Any] = self.backend.decode_batch([job.step for job in batch])  # type: ignore[misc]
        except Exception:  # one row may have broken the batch: each row alone, so only that row fails
            results = [self._alone(job) for job in batch]
        self._delivered(batch, results)

    def _alone(self, job: _Job) -> Any:
        """A decode step on the one-row path: its result, or the exception for its caller (never lost here)."""
        began, lm_head = time.perf_counter(), self.backend.lm_head_seconds
        try:
            result = decode_alone(self.backend, job.step)  # type: ignore[arg-type]
        except BaseException as exc:
            return exc
        if self.timed is not None:
            self._hint(functools.partial(self.timed, time.perf_counter() - began,
                                         self.backend.lm_head_seconds - lm_head))
        return result

    def _delivered(self, batch: list[_Job], results: list[Any]) -> None:
        """A decode batch's results to their callers."""
        if len(batch) > 1:
            self.batches += 1
            self.batched_steps += len(batch)
        sent = [job.step.session_id for job, result in zip(batch, results)
                if isinstance(result, TensorPayload) and job.step is not None]
        if sent and self._wave_kept():
            with self._ready:
                self._in_flight.sent(sent, time.monotonic())
        self._deliver(*[(job, replace(result, group=len(batch)) if isinstance(result, TensorPayload) else result)
                        for job, result in zip(batch, results)])  # (hidden states say how many came together)

    def _mark(self, computing: bool) -> None:
        """Tell the host's other nodes whether this one computes (`retune` first, or `rest`): idle before a job's first
        result goes out, since the next node, handed it, must not find this one computing and lend its kernels half
        the cores; computing again if the job computes more after that (a failed batch's rows one by one)."""
        if computing != self._computing:
            self._computing = computing
            self._hint(self.retune if computing else self.rest)

    def _deliver(self, *outcomes: tuple[_Job, Any]) -> None:
        """Results to their callers, a batch's in one turn of their event loop: its rows leave as one (`RowOutbox`)."""
        self._mark(False)

        def settle() -> None:
            for job, result in outcomes:
                if job.future.done():
                    continue  # the caller went away (cancelled)
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

        try:
            outcomes[0][0].loop.call_soon_threadsafe(settle)  # (one event loop calls a worker)
        except (RuntimeError, IndexError):
            pass  # the event loop is closed (nobody is waiting), or nothing to deliver
