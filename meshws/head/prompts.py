"""Chat messages -> prompt text, with the model's chat template or a plain transcript."""

from __future__ import annotations

from typing import Any


class PromptBuilder:
    DEFAULT_STOP = ["\nUser:"]  # what ends an answer in the plain transcript

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.renders_tools = isinstance(template, str) and "tools" in template  # else the API lays them out

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if self.has_template:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        lines = []
        for message in messages:
            if message["role"] == "system":
                lines.append(message["content"] + "\n")
            else:
                lines.append(f"{'User' if message['role'] == 'user' else 'Assistant'}: {message['content']}")
        return "\n".join(lines) + "\nAssistant:"
