"""The chunks of a streamed answer of the chat and completions family, built in one place.

Every chunk names its answer (`id`), its kind (`chat.completion.chunk` or `text_completion`), when the answer began
and the model, and carries choices; a choice's piece is a `delta` in a chat and `text` in a completion. One `Chunks`
serves a single answer, `n` > 1 choices and a batch of prompts alike (a batch's whole answer is framed the same way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Chunks:
    answer_id: str
    chat: bool
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def frame(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A chunk of these choices (none: the usage chunk), with `extra` fields after them."""
        return {"id": self.answer_id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def piece(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Choice `index`'s piece: its text (None: no content, as a chat's last chunk says), the role on a chat's
        first, why it ended on its last, and the log-probabilities of its tokens since the one before."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = {**({"role": "assistant"} if role else {}), **({"content": text} if text is not None
                                                                              else {})}
        else:
            choice["text"] = text or ""
        return choice

    def one(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chunk of one choice's piece."""
        return self.frame([self.piece(index, text, finish, role, logprobs)])
