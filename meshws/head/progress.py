"""What one generation holds so far, as its loop (`generation.Generator`) sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .drafts import Speculation


@dataclass
class Progress:
    """What a generation holds so far: the prompt, and the token ids (or a legacy tail's texts) after it."""

    prompt: str
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    legacy_text: list[str] = field(default_factory=list)
    step: int = 0  # the last step's number; they go on from a conversation's earlier answers
    reuse: int = 0  # positions the hops' caches keep from before: the next prefill starts after them
    held: int = 0  # positions every hop's cache holds after the last step that worked
    max_tokens: int = 0
    speculation: Speculation | None = None  # drafts for the decode laps (None: one token per lap)
    drafts: tuple[int, ...] = ()  # the guesses the last lap carried
    cached: int | None = None  # the fewest positions any prefill kept: prompt tokens this answer never ran

    def __len__(self) -> int:
        return len(self.tokens) + len(self.legacy_text)

    def ids(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def prefill_input(self) -> str | list[int]:
        """What a (re-)prefill runs: the token ids so far, or prompt + text with a legacy tail. It runs what
        follows the `reuse` positions kept (a warm session's, a standby's after a failover; 0 after a miss)."""
        self.cached = self.reuse if self.cached is None else min(self.cached, self.reuse)
        return self.prompt + "".join(self.legacy_text) if self.legacy_text else self.ids()
