"""The head's generation loop: one session channel per generation.

prefill -> token -> (decode -> token)* -> close. A `cache_miss` from any shard,
or from the head's own store, re-prefills prompt + tokens so far under the same
session id. A hop that answers without a `token_id` (a stateless, legacy tail)
gets a full re-prefill every step, and an empty text from it ends the
generation. A hop lost mid-generation (link dropped, no answer in time) is routed around: a new route without it,
the same session id, a re-prefill; a tail that had a standby (`mesh.standby`) is replaced by it, which runs only
the positions its copy lacks. While the head moves layers (`rebalance`), a generation parks at its next step
and goes on the same way on the new plan. EOS stops by token id, never by text. Whatever ends the loop (EOS,
`max_tokens`, the consumer closing the iterator, an error), the channel is
closed, which releases the session's caches on every shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from ..mesh.aio import run_uncancelled
from ..mesh.compute import ComputeWorker
from ..model.backend import DecodeStep, PrefillStep, ShardBackend, TailTokenResult
from ..model.kv.cache_store import CacheBudgetExceeded, KVCacheMiss
from ..model.text.sampling_params import SamplingParams
from .admission import Slot
from .channel import MAX_FAILOVERS, PipelineError, RoutedPath
from .conversation import Conversation
from .drafts import NgramDrafter, Speculation
from .planner import RoutePlanner
from .progress import Progress
from .routes import Route
from .stats import FinishReason, Fork, GenerationRequest, GenerationStats, TokenEvent
from .timing import LapTimes

log = logging.getLogger("meshws.generation")

MAX_CONSECUTIVE_CACHE_MISSES = 8


class Generator:
    """Runs generations on a head (or full) node."""

    def __init__(
        self,
        backend: ShardBackend,
        worker: ComputeWorker,
        *,
        planner: RoutePlanner,
        step_timeout: float,
        compress_min_bytes: int,
        on_finish: Callable[[GenerationStats, str], None] | None = None,
        secret: str | None = None,
        draft_tokens: int = 0,
        max_kept: int = 128,
    ) -> None:
        self.backend = backend
        self.worker = worker
        self.planner = planner
        self.step_timeout = step_timeout
        self.compress_min_bytes = compress_min_bytes
        self.on_finish = on_finish
        self.secret = secret
        self.draft_tokens = draft_tokens  # the most guesses per decode lap (0: no speculative decoding)
        self.eos_ids = set(backend.eos_token_ids())
        self.active: dict[str, GenerationStats] = {}
        self.kept: dict[str, Conversation] = {}  # conversations whose channel stays open between answers
        self.paths: dict[str, RoutedPath] = {}  # the routes of running generations (another choice forks one)
        self.max_kept = max_kept  # beyond, the least recently used idle one is closed
        self.reuse_hits = self.reuse_misses = self.reused_tokens = 0  # answers of warm conversations

    async def generate(self, request: GenerationRequest, stats: GenerationStats | None = None,
                       route: Route | None = None, slot: Slot | None = None,
                       conversation: Conversation | None = None, fork: Fork | None = None,
                       prefilled: asyncio.Event | None = None) -> AsyncIterator[TokenEvent]:
        """Yield tokens as they come. Close the iterator (aclosing) to stop early.

        `route` is the route admission planned; without one, the generation plans its own.
        `slot`, the admission's, is released only after the session's release has run.
        With a `conversation`, the session is its own: a warm one is resumed (only the
        prompt's tokens after what its caches hold are prefilled), and an answer that ends
        cleanly keeps it open for the next; one that fails or is cancelled mid-step ends it.
        A `fork` (another choice of an `n` > 1 request) starts from a copy of the first
        choice's caches on its route, so only the prompt's last token runs again;
        `prefilled` is set once this generation's prompt is in its caches (or it ended).
        """
        stats = stats or GenerationStats(sid=uuid.uuid4().hex)
        if conversation is not None:
            stats.sid = conversation.sid
        sid = stats.sid
        self.active[sid] = stats
        warm = conversation is not None and conversation.warm
        kept = self.kept.get(fork.sid) if fork is not None else None  # (a shared prompt prefix)
        parent = self.paths.get(fork.sid, kept.path if kept else None) if fork is not None else None
        if parent is not None and parent.route is not None:  # the parent's route: its caches are there
            if route is not None:
                route.release()
            route = self.planner.hold(replace(parent.route, on_done=None))
        path = conversation.path if warm else RoutedPath(self.planner, sid, route, self.step_timeout,
                                                         self.compress_min_bytes, self.secret)
        if stats.internal:  # a shared prompt prefix: counted apart from users' sessions on every shard
            path.kept = True
            self.backend.sessions.keep_apart(sid)
        if warm and route is not None:
            route.release()  # the conversation goes on along its own route
        speculation = Speculation(NgramDrafter(), self.draft_tokens) \
            if self.draft_tokens and self.backend.supports_kv_cache else None
        sequence = Progress(request.prompt, [], step=conversation.steps if conversation else 0,
                             max_tokens=request.max_tokens, speculation=speculation)
        stats.speculation = speculation
        outcome, clean = "error", False
        try:
            prompt_ids = request.prompt_ids
            if prompt_ids is None:
                prompt_ids = await self.worker.call(self.backend.tokenize, request.prompt)
            sequence.prompt_ids = prompt_ids
            stats.prompt_tokens = len(prompt_ids)
            self.paths[sid] = path
            if warm:
                sequence.reuse = await self._resume(path, conversation, request.sampling, prompt_ids, stats)
            elif parent is not None:
                await path.open(request.sampling, len(prompt_ids), (fork.sid, fork.length))
                forked = await self.worker.call(self.backend.fork_session, fork.sid, sid, fork.length)
                sequence.reuse = fork.length if forked else 0
            else:
                await path.open(request.sampling, len(prompt_ids))
            stats.route = path.view
            async with aclosing(self._loop(request, stats, sequence, path, prefilled)) as events:
                async for event in events:  # (closed with this one: its queued head step is cancelled first)
                    yield event
            outcome = stats.finish_reason.value if stats.finish_reason else "stopped"
            clean = True
        except GeneratorExit:
            outcome, clean = "stopped", True  # closed between tokens: no step is on its way (the head's was cancelled)
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if prefilled is not None:
                prefilled.set()
            self.paths.pop(sid, None)
            stats.finished_at = time.perf_counter()
            stats.cached_tokens = min(sequence.cached or 0, len(sequence.prompt_ids))  # (fewer after a fault)
            self.active.pop(sid, None)
            try:
                if conversation is not None and clean and sequence.held and self.backend.supports_kv_cache \
                        and not sequence.legacy_text:
                    conversation.path, conversation.held = path, sequence.ids()[:sequence.held]
                    conversation.steps, conversation.last_used = sequence.step, time.monotonic()
                    self.kept[sid] = conversation
                    await run_uncancelled(self._within_bound())
                else:
                    if conversation is not None:
                        self._forget(conversation)
                    await run_uncancelled(self._release(path, sid))
            finally:
                if slot is not None:
                    slot.release()
                if self.on_finish is not None:
                    self.on_finish(stats, outcome)

    async def _resume(self, path: RoutedPath, conversation: Conversation, sampling: SamplingParams,
                      prompt_ids: list[int], stats: GenerationStats) -> int:
        """Open a warm conversation's next answer; the positions its caches may keep (0 if the route is gone)."""
        reuse = conversation.reusable(prompt_ids)
        try:
            await path.resume(sampling, len(prompt_ids))
        except PipelineError as exc:  # the route's first hop went away while the conversation was idle
            log.info("session %s: could not resume (%s); its standby, or a new route", conversation.sid[:12], exc)
            reuse = min(reuse, await path.after_loss(exc, sampling, len(prompt_ids), stats))
        if reuse > 0:
            self.reuse_hits += 1
            self.reused_tokens += reuse
        else:
            self.reuse_misses += 1
        return reuse

    async def end(self, conversation: Conversation) -> None:
        """A conversation's holder let it go: its channel closes and every hop releases its cache."""
        sid = conversation.sid
        path = self._forget(conversation)
        if path is not None:
            await run_uncancelled(self._release(path, sid))

    def _forget(self, conversation: Conversation) -> RoutedPath | None:
        """The conversation's session ends; its next answer opens a new one under a new id."""
        path = conversation.path
        self.kept.pop(conversation.sid, None)
        conversation.renew()
        return path

    async def _within_bound(self) -> None:
        """Close the least recently used idle kept sessions beyond `max_kept` (their next answer prefills in full)."""
        idle = sorted((c for sid, c in self.kept.items() if sid not in self.active), key=lambda c: c.last_used)
        for conversation in idle[: max(0, len(self.kept) - self.max_kept)]:
            log.info("session %s: closed, the oldest of more than %d kept between answers", conversation.sid[:12],
                     self.max_kept)
            await self.end(conversation)

    async def _release(self, path: RoutedPath, sid: str) -> None:
        """Close the channel (every shard drops the session) and drop the head's own cache."""
        await path.close()
        await self.worker.release(sid)  # ahead of queued prefills

    async def _loop(self, request: GenerationRequest, stats: GenerationStats, sequence: Progress, path: RoutedPath,
                    prefilled: asyncio.Event | None = None) -> AsyncIterator[TokenEvent]:
        sid, sampling = stats.sid, request.sampling
        need_prefill, misses = True, 0
        ahead: tuple[asyncio.Future, list[float]] | None = None  # the next lap's head step (`_timed`), queued early
        try:
            while len(sequence) < request.max_tokens:
                placement = self.planner.placement
                if placement is not None and placement.switching and path.channel is not None:
                    if ahead is not None:  # computed on the head's layers as they were: not wanted
                        _abandon(ahead[0])
                        ahead = None
                    log.info("session %s: parked while layers move", sid[:12])  # (`rebalance`)
                    await self._release(path, sid)  # every hop and the head drop its caches
                    await path.open(sampling, len(sequence.prompt_ids))  # on the new plan, once in force
                    stats.moves, stats.route = stats.moves + 1, path.view
                    need_prefill, sequence.reuse = True, 0  # prompt and tokens so far again
                sequence.step += 1
                stats.prefills += 1 if need_prefill else 0
                try:
                    early, ahead = ahead, None
                    result = await self._lap(sid, sequence.step, need_prefill, sequence, sampling, path, stats.times,
                                             early)
                except KVCacheMiss as exc:
                    misses += 1
                    stats.cache_misses += 1
                    if misses > MAX_CONSECUTIVE_CACHE_MISSES:
                        raise PipelineError(f"{misses} cache misses in a row: {exc}") from exc
                    log.info("session %s: cache miss on a lap with %d drafts (%s); re-prefilling", sid[:12],
                             0 if need_prefill else len(sequence.drafts), exc)
                    kept = await path.after_miss(exc, sampling, len(sequence.prompt_ids), stats)  # (a standby's)
                    need_prefill, sequence.reuse = True, min(kept, sequence.held)
                    continue
                except PipelineError as exc:
                    if not exc.lost or stats.failovers >= MAX_FAILOVERS or path.channel is None:
                        raise
                    log.warning("session %s: lost a lap with %d drafts", sid[:12],
                                0 if need_prefill else len(sequence.drafts))
                    need_prefill, sequence.reuse = True, await path.failover(  # (0, or what a standby's copy holds)
                        exc, sampling, len(sequence.prompt_ids), stats, max(sequence.held, sequence.reuse),
                        len(sequence.ids()))
                    continue
                except (ValueError, CacheBudgetExceeded) as exc:  # a step refused by the head's own shard (bad
                    raise PipelineError(str(exc)) from exc  # length, dtype; a session its KV budget cannot hold)
                finally:
                    self.worker.returned(sid)  # back from the route: the head's wave no longer waits for it
                misses = 0
                if prefilled is not None:
                    prefilled.set()  # the prompt is in every cache of the route: other choices may fork it
                if need_prefill and not sequence.reuse and stats.prompt_logprobs is None and result.prompt_logprobs:
                    stats.prompt_logprobs = result.prompt_logprobs
                # 1 token, or after a lap with drafts the ones the tail kept and its own: all fed but the last
                tokens = result.token_ids or (result.token_id,)
                if not need_prefill and sequence.speculation is not None:
                    sequence.speculation.record(len(sequence.drafts), len(tokens) - 1)
                sequence.held = len(sequence.ids()) if need_prefill else sequence.held + len(tokens)
                stats.lap_arrived()
                if result.token_id is None:  # a legacy tail: text only, an empty text ends; prefill every step
                    if not result.text:
                        stats.finish_reason = FinishReason.STOP
                        return
                    sequence.legacy_text.append(result.text)
                    stats.completion_tokens += 1
                    need_prefill = True
                    yield TokenEvent(None, result.text)
                    continue
                need_prefill = not self.backend.supports_kv_cache
                for index, token in enumerate(tokens):  # streamed one by one, as without drafts
                    if token in self.eos_ids and not request.ignore_eos:
                        stats.finish_reason = FinishReason.STOP
                        return
                    sequence.tokens.append(token)
                    stats.completion_tokens += 1
                    logprob = result.logprobs[index] if index < len(result.logprobs) else None
                    if logprob is not None and stats.logprobs is not None:
                        stats.logprobs.append((token, logprob))
                    if index == len(tokens) - 1 and not need_prefill and len(sequence) < request.max_tokens:
                        # queued before the token is streamed (a stop string wastes it: caches are cut back), and
                        # the write waits a turn of the loop: the wave's other steps read with this one queue theirs
                        # first, and its batch starts before their SSE writes, which run beside its products
                        ahead = _timed(self._head_step(sid, sequence, sampling))
                        await asyncio.sleep(0)
                    yield TokenEvent(token, logprob=logprob)
                    if len(sequence) >= request.max_tokens:
                        break
            stats.finish_reason = FinishReason.LENGTH
        finally:
            if ahead is not None:  # closed (a stop string, a client gone) or failed before that lap: not wanted
                _abandon(ahead[0])

    async def _lap(self, sid: str, step: int, prefill: bool, sequence: Progress, sampling: SamplingParams,
                   path: RoutedPath, times: LapTimes, early: tuple[asyncio.Future, list[float]] | None = None) \
            -> TailTokenResult:
        """One step through the head's layers and the route: a (re-)prefill, or one token's decode (its head
        step `early` if that was queued already, `_timed`: the lap's times leave out the consumer's meanwhile).

        A prefill after `sequence.reuse` kept positions runs only the tokens after them, as a
        multi-position "decode" at that length: every hop cuts its cache back to it first.
        """
        began = time.perf_counter()
        result = await (self._head_part(sid, prefill, sequence, sampling) if early is None else early[0])
        head = time.perf_counter() - began if early is None else early[1][-1] - early[1][0]
        began, head_ms = (began if early is None else time.perf_counter() - head), head * 1000
        positions = len(sequence.ids()) - sequence.reuse if prefill else 1 + len(sequence.drafts)
        if not isinstance(result, TailTokenResult):  # hidden states for the route (a full node has sampled)
            mode = "decode" if prefill and sequence.reuse else "prefill"
            ids = sequence.ids() if prefill and sampling.needs_history else None
            result = await path.step(step, mode if prefill else "decode", result, ids,
                                     () if prefill else sequence.drafts)
        times.record(positions=positions, tokens=len(result.token_ids) or 1, head_ms=head_ms, hops=result.hops,
                     lap_ms=(time.perf_counter() - began) * 1000, head_cache=self.backend.sessions.held(sid))
        return result

    async def _head_part(self, sid: str, prefill: bool, sequence: Progress, sampling: SamplingParams) -> Any:
        """The lap's step through the head's own layers: the hidden states to send on (a full node: the token)."""
        prompt_length = len(sequence.prompt_ids)
        cached_sid = sid if self.backend.supports_kv_cache else None
        prefill_input = sequence.prefill_input() if prefill else None
        mode = "decode" if prefill and sequence.reuse else "prefill"
        if isinstance(prefill_input, str):  # prompt + text for a legacy tail: tokenized and run whole
            return await self.worker.call(self.backend.encode_prompt, prefill_input, cached_sid,
                                            sampling=sampling, generated_from=prompt_length)
        if prefill_input is not None:  # in chunks, with other sessions' decode steps in between
            return await self.worker.prefill(PrefillStep(
                cached_sid, token_ids=prefill_input[sequence.reuse:], mode=mode, past_len=sequence.reuse,
                sampling=sampling, history=prefill_input if sampling.needs_history else (),
                generated_from=prompt_length))
        return await self._head_step(sid, sequence, sampling)

    def _head_step(self, sid: str, sequence: Progress, sampling: SamplingParams) -> asyncio.Future:
        """A decode lap's step through the head's own layers (with drafts, if any), queued on the worker now."""
        prompt_length = len(sequence.prompt_ids)
        cached_sid = sid if self.backend.supports_kv_cache else None
        history = sequence.ids() if sampling.needs_history else ()
        speculation, last = sequence.speculation, sequence.tokens[-1]
        room = sequence.max_tokens - len(sequence) - 1  # guesses beyond the answer's end are wasted
        sequence.drafts = tuple(speculation.propose(sequence.ids(), room, len(self.active))) if speculation else ()
        if sequence.drafts:  # the last token and the guesses, verified by the tail in one lap
            return self.worker.prefill_now(PrefillStep(
                cached_sid, token_ids=[last, *sequence.drafts], mode="decode", past_len=sequence.held,
                sampling=sampling, history=history, generated_from=prompt_length, drafts=sequence.drafts))
        return self.worker.decode_now(DecodeStep(sid, token_id=last, sampling=sampling, history=history,
                                                 generated_from=prompt_length, past_len=sequence.held))


def _timed(future: asyncio.Future) -> tuple[asyncio.Future, list[float]]:
    """A queued step and [when it was queued, when it was done] (the second once it is)."""
    times = [time.perf_counter()]
    future.add_done_callback(lambda _: times.append(time.perf_counter()))
    return future, times


def _abandon(future: asyncio.Future) -> None:
    """A queued step nobody will await: cancelled (the worker skips it), or its outcome taken if it has one."""
    if not future.cancel() and not future.cancelled():
        future.exception()  # (retrieved: no "exception was never retrieved" in the log)
