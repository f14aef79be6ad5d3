"""Chat messages -> prompt text, with the model's chat template or a plain transcript."""

from __future__ import annotations

from typing import Any


class PromptBuilder:
    DEFAULT_STOP = ["\nUser:"]  # what ends an answer in the plain transcript

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.has_template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        lines = []
        for message in messages:
            if message["role"] == "system":
                lines.append(message["content"] + "\n")
            else:
                lines.append(f"{'User' if message['role'] == 'user' else 'Assistant'}: {message['content']}")
        return "\n".join(lines) + "\nAssistant:"
