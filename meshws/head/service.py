"""`HeadService`: what the public surfaces may ask of a head, and nothing more.

The API and `/ws/chat` learn the model's facts here, tokenize and detokenize
through it, ask it to admit a request (a route must exist and the head must have
room) and run generations as streams of text. They never see the node.
"""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from ..mesh.compute import ComputeWorker
from ..model.backend import ShardBackend
from .generation import GenerationRequest, GenerationStats, Generator
from .planner import RoutePlanner
from .prompts import PromptBuilder
from .routes import NoRoute, Route
from .text_stream import stream_completion


class Unavailable(Exception):
    """The head cannot take a request now; `retry_after` says when to try again (seconds)."""

    def __init__(self, message: str, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class HeadService:
    def __init__(self, backend: ShardBackend, worker: ComputeWorker, generator: Generator, planner: RoutePlanner,
                 max_generations: int) -> None:
        self._backend = backend
        self._worker = worker
        self._generator = generator
        self._planner = planner
        self.max_generations = max_generations
        self.model_id = backend.model_id
        self.context_length = backend.context_length
        self.vocab_size = backend.vocab_size
        self.prompts = PromptBuilder(backend.tokenizer)

    @property
    def generations(self) -> int:
        """Generations running now."""
        return len(self._generator.active)

    async def tokenize(self, text: str) -> list[int]:
        return await self._worker.call(self._backend.tokenize, text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._backend.decode(token_ids)

    def admit(self) -> Route:
        """The route for a new generation, held from now on, or Unavailable when there is no room or no route.

        The caller must `release()` the route when the request ends (the generation
        releases it too; a second release does nothing).
        """
        active = self.generations
        if active >= self.max_generations:
            raise Unavailable(f"the head is running {active} generations, its limit; retry shortly",
                              "over_capacity", retry_after=1)
        try:
            return self._planner.hold(self._planner.plan())
        except NoRoute as exc:
            raise Unavailable(str(exc), "no_route", retry_after=2) from exc

    def stream(self, request: GenerationRequest, stop: Sequence[str], stats: GenerationStats, route: Route,
               token_ids: list[int] | None = None) -> AsyncIterator[str]:
        """The answer's text as it is decided; stats fill in as it runs."""
        return stream_completion(self._generator, request, self.decode, stop, stats, token_ids, route)
