"""From token ids to streamed text: incremental detokenisation and stop strings.

Text is given out only once it is decided: an incomplete UTF-8 sequence (a
trailing U+FFFD from the tokenizer) waits for the next token, and text that
might be the start of a stop string waits until it is known not to be. The stop
string itself is never given out; special tokens (EOS) are skipped by decode.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, Callable, Sequence

from .generation import FinishReason, GenerationRequest, GenerationStats, Generator
from .stats import Fork
from .admission import Slot
from .conversation import Conversation
from .routes import Route

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are already text
        self._read_offset = 0
        self._pending = ""  # decided by the tokenizer, held back for stop strings
        self.text = ""  # everything given out so far
        self.stopped = False  # a stop string was found

    def push_token(self, token_id: int) -> str:
        """Add a token; returns the text that can be given out now."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # nothing decided yet (e.g. half a multi-byte character)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self.push_text(full[len(prefix) :])

    def push_text(self, text: str) -> str:
        """Add decided text (also what a legacy tail sends); returns what can be given out."""
        if self.stopped:
            return ""
        self._pending += text
        cut = self._find_stop()
        if cut is not None:
            out, self._pending, self.stopped = self._pending[:cut], "", True
        else:
            hold = self._held_back()
            out = self._pending[: len(self._pending) - hold]
            self._pending = self._pending[len(out) :]
        self.text += out
        return out

    def finish(self) -> str:
        """The generation ended: give out what was held back (an undecodable tail included)."""
        if self.stopped:
            return ""
        tail = self._decode(self._ids[self._prefix_offset :])
        undecided = tail[len(self._decode(self._ids[self._prefix_offset : self._read_offset])) :]
        out = self._pending + undecided
        cut = self._find_stop(out)
        if cut is not None:
            out, self.stopped = out[:cut], True
        self._pending = ""
        self.text += out
        return out

    def _find_stop(self, text: str | None = None) -> int | None:
        text = self._pending if text is None else text
        found = [index for index in (text.find(stop) for stop in self._stop) if index >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest end of the pending text that starts some stop string (shorter than it). Only ends
        that begin with the stop string's first character are tried, each once."""
        longest, pending = 0, self._pending
        for stop in self._stop:
            at = pending.find(stop[0], max(0, len(pending) - len(stop) + 1))
            while at >= 0 and len(pending) - at > longest:
                if stop.startswith(pending[at:]):
                    longest = len(pending) - at
                    break
                at = pending.find(stop[0], at + 1)
        return longest


async def stream_completion(
    generator: Generator,
    request: GenerationRequest,
    decode: Callable[[list[int]], str],
    stop: Sequence[str],
    stats: GenerationStats,
    token_ids: list[int] | None = None,
    route: Route | None = None,
    slot: Slot | None = None,
    conversation: Conversation | None = None,
    fork: Fork | None = None,
    prefilled: asyncio.Event | None = None,
) -> AsyncIterator[str]:
    """Text deltas of one generation; a stop string ends it with finish_reason "stop"."""
    text = TextStream(decode, stop)
    async with aclosing(generator.generate(request, stats, route, slot, conversation, fork, prefilled)) as events:
        async for event in events:
            if event.token_id is not None:
                if token_ids is not None:
                    token_ids.append(event.token_id)
                delta = text.push_token(event.token_id)
            else:
                delta = text.push_text(event.text or "")
            if delta:
                yield delta
            if text.stopped:
                stats.finish_reason = FinishReason.STOP
                return
    delta = text.finish()
    if text.stopped:
        stats.finish_reason = FinishReason.STOP
    if delta:
        yield delta
