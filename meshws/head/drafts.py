"""Speculative decoding's head side: guessing the next tokens, and how many to guess.

Across a real network the link delay sets the pace of one token per lap. A lap can
carry several positions: the last token plus up to K guesses ("drafts"); the tail
keeps the guesses its own choices agree with and adds one more, so a lap yields 1 to
K+1 tokens, exactly those of decoding one by one (`sampling.verify_drafts`).

`NgramDrafter` is prompt lookup: the tokens that followed the latest earlier occurrence
of the text's last 3 (else 2) tokens, from the prompt and the answer so far —
no second model; strong where the answer quotes, edits or repeats. A drafter is
anything with `propose(ids, count)`, so a small draft model can plug in later.
`Speculation` keeps one generation's drafter state and adapts K to what the tail
accepted: more after a lap that kept every guess, fewer after one that kept few, and
none for a while after guesses keep failing, so plain chat pays (almost) nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

MAX_NGRAM = 3
MIN_NGRAM = 2  # a single matching token guesses badly in ordinary text (measured: most such laps kept nothing)
COOL_DOWN_LAPS = 16  # laps without drafts after two laps in a row kept none
MISSES_BEFORE_COOL_DOWN = 2
# A lap with guesses is a step of its own on every shard, never batched with other sessions' one-token steps.
# So with more generations than this running at once, laps carry no guesses (vLLM likewise turns speculation
# off above a batch size). Head + tail fp32 on 2 cores, 16 sessions: 100-110 tok/s aggregate and a p95 gap
# of 0.67 s with guesses, 153-162 tok/s and 0.12 s without.
DRAFTS_UP_TO_GENERATIONS = 3


class Drafter(Protocol):
    def propose(self, ids: Sequence[int], count: int) -> list[int]:
        """Up to `count` guesses of the tokens after `ids`."""
        ...


class NgramDrafter:
    """Prompt lookup over one sequence, indexed as it grows (a lookup is O(1), not a scan)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        self._indexed = 0  # positions whose following token is indexed
        self._last: int | None = None  # the token at position `_indexed - 1`: a cheap check of the same sequence

    def propose(self, ids: Sequence[int], count: int) -> list[int]:
        if count <= 0 or len(ids) < 2:
            return []
        self._index(ids)
        for size in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            follow = self._latest.get(tuple(ids[-size:]))
            if follow is not None:
                return list(ids[follow : follow + count])
        return []

    def _index(self, ids: Sequence[int]) -> None:
        if len(ids) < self._indexed or (self._indexed and ids[self._indexed - 1] != self._last):
            self._latest, self._indexed = {}, 0  # another sequence: start again
        for end in range(max(self._indexed, 1), len(ids)):  # the token at `end` follows the n-grams before it
            for size in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest[tuple(ids[end - size : end])] = end
        self._indexed, self._last = len(ids), ids[-1]


@dataclass
class Speculation:
    """One generation's drafts: the drafter, the current number of guesses, and what the tail kept."""

    drafter: Drafter
    max_tokens: int  # the most guesses per lap (--draft-tokens)
    k: int = field(init=False)
    laps: int = 0  # decode laps
    drafted: int = 0  # guesses sent
    accepted: int = 0  # guesses the tail kept
    _misses: int = 0  # laps in a row whose guesses were all refused
    _cool_down: int = 0

    def __post_init__(self) -> None:
        self.k = min(2, self.max_tokens)

    def propose(self, ids: Sequence[int], room: int, running: int = 1) -> list[int]:
        """Guesses for the next lap; at most `room` (tokens the answer may still take, less one), and none while
        more than DRAFTS_UP_TO_GENERATIONS generations (`running`) share the mesh."""
        if running > DRAFTS_UP_TO_GENERATIONS:
            return []
        if self._cool_down:
            self._cool_down -= 1
            return []
        return self.drafter.propose(ids, min(self.k, room))

    def record(self, drafted: int, kept: int) -> None:
        """A decode lap carried `drafted` guesses; the tail kept `kept` of them."""
        self.laps += 1
        self.drafted += drafted
        self.accepted += kept
        if not drafted:
            return
        if kept == drafted:
            self.k, self._misses = min(self.max_tokens, self.k + 2), 0
        elif kept == 0:
            self.k, self._misses = max(1, self.k // 2), self._misses + 1
            if self._misses >= MISSES_BEFORE_COOL_DOWN:
                self._cool_down, self._misses = COOL_DOWN_LAPS, 0
        else:
            self.k, self._misses = max(1, kept + 1), 0

    def describe(self) -> dict[str, float | int]:
        """Per answer: decode laps, guesses sent and kept, tokens per decode lap (the usage extension)."""
        return {"laps": self.laps, "draft_tokens": self.drafted, "accepted_draft_tokens": self.accepted,
                "tokens_per_lap": round((self.laps + self.accepted) / self.laps, 3) if self.laps else 0.0}
