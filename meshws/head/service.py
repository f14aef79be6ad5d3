"""`HeadService`: what the public surfaces may ask of a head, and nothing more.

The API and `/ws/chat` learn the model's facts here, tokenize and detokenize
through it, compile structured output's grammars with it, ask it to admit a request (a route must exist, and a
generation slot be free or become free while the request waits in the admission queue) and run
generations as streams of text. They never see the node.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from ..mesh.aio import run_uncancelled
from ..mesh.compute import ComputeWorker
from ..model.backend import ShardBackend
from .admission import AdmissionQueue, Refused, Slot
from .conversation import Conversation, WarmPool
from .prefixes import PrefixPool, hold_prefix
from .generation import GenerationRequest, GenerationStats, Generator
from .grammars import GrammarCompiler
from .planner import RoutePlanner
from .prompts import PromptBuilder
from .routes import NoRoute, Route
from .stats import Fork
from .text_stream import stream_completion

log = logging.getLogger("meshws.head")

# /ws/chat conversations kept open between turns beyond the running generations and the warm pool; past
# that the least recently used idle one is closed (its next turn prefills in full). A first hop's link
# carries at most 256 sessions (--max-link-sessions); idle conversations must never fill it.
KEPT_CONVERSATIONS = 64


class Unavailable(Exception):
    """The head cannot take a request now; `retry_after` says when to try again (seconds)."""

    def __init__(self, message: str, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


@dataclass
class Admission:
    """What an admitted request holds: a generation slot and a route. `release()` is idempotent."""

    slot: Slot
    route: Route

    def release(self) -> None:
        self.route.release()
        self.slot.release()


@dataclass
class ChoiceOf:
    """Where a choice of an `n` > 1 request stands: the first one tells when its prompt is prefilled
    (`prefilled`); the others fork it."""

    prefilled: asyncio.Event | None = None
    fork: Fork | None = None


class HeadService:
    def __init__(self, backend: ShardBackend, worker: ComputeWorker, generator: Generator, planner: RoutePlanner,
                 queue: AdmissionQueue, warm_sessions: int = 0, warm_ttl: float = 300.0,
                 aliases: Sequence[str] = (), shared_prefixes: int = 0) -> None:
        self._backend = backend
        self._worker = worker
        self._generator = generator
        self._planner = planner
        self.queue = queue
        self.max_generations = queue.slots
        self.model_id = backend.model_id
        self.served_names = tuple(dict.fromkeys((backend.model_id, *aliases)))  # what requests may call it
        self.context_length = backend.context_length
        self.vocab_size = backend.vocab_size
        self.prompts = PromptBuilder(backend.tokenizer)
        self.grammars = GrammarCompiler()  # structured output's grammars: off the loop, bounded (`grammars`)
        self.warm = WarmPool(warm_sessions, warm_ttl, generator.end)
        self.prefixes = PrefixPool(shared_prefixes, lambda tokens, fork: hold_prefix(generator, tokens, fork),
                                   generator.end, ttl=warm_ttl)  # (kept sessions, as the pool's: one TTL)

    @property
    def generations(self) -> int:
        """Generations running now, or still releasing their sessions (each holds a slot)."""
        return self.queue.running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self.queue.waiting

    async def tokenize(self, text: str) -> list[int]:
        return await self._worker.call(self._backend.tokenize, text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids; an id outside the vocabulary (from a peer that should know better) is skipped."""
        vocab = self.vocab_size or 2**31
        return self._backend.decode([token for token in token_ids if 0 <= token < vocab])

    async def admit(self) -> Admission:
        """A slot and a held route for a new request, after waiting in line if need be.

        Unavailable when there is no route, the queue is full, the wait timed out or the
        head is draining. A cancelled caller leaves the queue at once. The caller must
        `release()` the admission when the request ends (the generation releases it too,
        after its session's release has run).
        """
        placement = self._planner.placement
        if placement is not None and placement.switching:
            await placement.wait_settled()  # layers are moving: a route on the new plan, in a moment
        try:
            self._planner.plan()  # no route: refused now rather than after a wait
            slot = await self.queue.enter()
        except NoRoute as exc:
            raise Unavailable(str(exc), "no_route", retry_after=2) from exc
        except Refused as exc:
            raise Unavailable(str(exc), exc.code, exc.retry_after) from exc
        try:
            return Admission(slot, self._planner.hold(self._planner.plan()))
        except NoRoute as exc:
            slot.release()
            raise Unavailable(str(exc), "no_route", retry_after=2) from exc

    async def admit_local(self) -> Slot:
        """A generation slot for work on this head alone (tokenizing a request's text): no route needed, the same
        queue and limits as generations. Unavailable when there is none to have."""
        try:
            return await self.queue.enter()
        except Refused as exc:
            raise Unavailable(str(exc), exc.code, exc.retry_after) from exc

    def stream(self, request: GenerationRequest, stop: Sequence[str], stats: GenerationStats, admission: Admission,
               token_ids: list[int] | None = None, conversation: Conversation | None = None,
               owner: str | None = None, choice: ChoiceOf | None = None,
               prefix_key: str | None = None) -> AsyncIterator[str]:
        """The answer's text as it is decided; stats fill in as it runs. Close it (aclosing) to stop early.

        With a `conversation` (a /ws/chat socket's), the answer goes on in its session.
        Without one, and with a warm pool, the request adopts the warm session sharing the
        longest prefix with its prompt among those of the same `owner` (if any), and leaves
        its own session in the pool. No `owner` (`cache_prompt: false`): no pool. Sessions
        never cross owners: a shared prefix's cached length would tell one client what
        another one sent. A new session (not a warm one) starts from the shared prompt prefix
        of its `prefix_key` (`prefixes`), if it has one; None: none.
        """
        if choice is not None:  # one of an `n` > 1 request's choices: the admission is the request's, held to its end
            route = admission.route if choice.fork is None else None
            return stream_completion(self._generator, request, self.decode, stop, stats, token_ids, route, None,
                                     None, choice.fork, choice.prefilled)
        pooled = conversation is None and bool(self.warm.size) and owner is not None
        return self._streamed(request, stop, stats, admission, token_ids, conversation, owner if pooled else None,
                              prefix_key)

    async def _streamed(self, request: GenerationRequest, stop: Sequence[str], stats: GenerationStats,
                        admission: Admission, token_ids: list[int] | None, conversation: Conversation | None,
                        owner: str | None, prefix_key: str | None) -> AsyncIterator[str]:
        if owner is not None:  # the warm pool's
            conversation = self.warm.adopt(request.prompt_ids or [], owner) or Conversation(owner=owner)
        fork, computed = None, 0
        try:
            if prefix_key is not None and request.prompt_ids and (conversation is None or not conversation.warm):
                fork, computed = await self.prefixes.fork_for(request.prompt_ids, prefix_key) or (None, 0)
            async with aclosing(stream_completion(self._generator, request, self.decode, stop, stats, token_ids,
                                                  admission.route, admission.slot, conversation, fork)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if fork is not None and stats.cache_misses and stats.cached_tokens < fork.length:  # a shard lost it
                await run_uncancelled(self.prefixes.spoiled(fork))
            stats.cached_tokens = max(0, stats.cached_tokens - computed)  # (this request's own build: not cached)
            if owner is not None:
                await run_uncancelled(self.warm.put(conversation))

    async def warm_ctx(self, app: object) -> AsyncIterator[None]:
        """An aiohttp cleanup context: the warm pool's TTL is kept while the node runs; its sessions end at stop."""
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(self.warm.ttl / 4, 5.0))
                try:
                    await self.warm.sweep()
                    await self.prefixes.sweep()
                except Exception:  # the sweep goes on whatever one release raised
                    log.exception("sweeping the warm pool failed")

        task = asyncio.create_task(sweep())
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await self.warm.clear()
        await self.prefixes.clear()

    async def end_conversation(self, conversation: Conversation) -> None:
        """Close a conversation's session on every hop (a /ws/chat reset or close)."""
        await self._generator.end(conversation)

    def running_sessions(self) -> set[str]:
        """The sessions of the generations running now."""
        return set(self._generator.active)

    async def end_idle_conversations(self) -> None:
        """Close every session kept between answers that no answer runs on now (layers are moving: each one's next
        answer opens a new session)."""
        generator = self._generator
        for sid, conversation in list(generator.kept.items()):
            if sid not in generator.active:
                await generator.end(conversation)

    @property
    def conversations(self) -> int:
        """Sessions kept open between answers: /ws/chat conversations and the warm pool."""
        return len(self._generator.kept)

    @property
    def reuse(self) -> dict[str, int]:
        """Answers that resumed a kept session: with cached positions (hits) or none, and positions reused."""
        generator = self._generator
        return {"hits": generator.reuse_hits, "misses": generator.reuse_misses,
                "reused_tokens": generator.reused_tokens}


def build_head(backend: ShardBackend, worker: ComputeWorker, planner: RoutePlanner, settings: Any,
               on_finish: Callable[[GenerationStats, str], None]) -> HeadService:
    """A head's service as the node's settings (`config.NodeSettings`) ask for it."""
    generator = Generator(backend, worker, planner=planner, step_timeout=settings.step_timeout,
                          compress_min_bytes=settings.compress_min_bytes, on_finish=on_finish,
                          secret=settings.secret,
                          draft_tokens=settings.draft_tokens if settings.draft == "ngram" else 0,
                          max_kept=settings.max_generations + settings.warm_sessions + settings.shared_prefixes
                          + KEPT_CONVERSATIONS)
    queue = AdmissionQueue(settings.max_generations, settings.max_queue, settings.queue_timeout)
    return HeadService(backend, worker, generator, planner, queue, settings.warm_sessions, settings.warm_ttl,
                       settings.served_model_name, settings.shared_prefixes)
