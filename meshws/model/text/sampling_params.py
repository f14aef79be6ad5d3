"""A session's sampling settings: plain data that travels on the wire and is checked where it arrives.

No torch here: the mesh and the head read and pass these settings; only the tail's `sampling` computes with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    repetition_penalty: float = 1.0  # HF-style: divides positive logits of seen tokens
    frequency_penalty: float = 0.0  # OpenAI-style: minus count x penalty for generated tokens
    presence_penalty: float = 0.0  # OpenAI-style: minus penalty for tokens generated at least once
    seed: int | None = None  # makes sampled output reproducible
    logprobs: int | None = None  # report each token's log-probability and this many likeliest alternatives
    prompt_logprobs: bool = False  # ... and, from a prefill, each prompt token's (completions' `echo`)
    grammar: str | None = None  # an llguidance grammar the answer must follow (structured output)

    @property
    def greedy(self) -> bool:
        """Argmax below GREEDY_BELOW, as vLLM (logits over a temperature of 1e-38 overflow to infinities, whose
        softmax is NaN: sampling would fail where its limit is the greedy choice)."""
        return self.temperature < GREEDY_BELOW

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the tokens so far (the head then sends them)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.prompt_logprobs  # the tail reads each prompt token's log-probability
            or self.grammar is not None  # the grammar's state is the tokens generated so far
        )

    def to_wire(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value != getattr(DEFAULT, key)}

    @classmethod
    def from_wire(cls, data: Any) -> "SamplingParams":
        """Validate sampling settings received from a peer; ValueError names the bad field."""
        if data is None:
            return DEFAULT
        if not isinstance(data, dict):
            raise ValueError("sampling must be an object")
        fields: dict[str, Any] = {}
        for key, value in data.items():
            if key not in _FIELD_TYPES:
                raise ValueError(f"unknown sampling field {key!r}")
            kind = _FIELD_TYPES[key]
            if value is None and key in ("seed", "logprobs", "grammar"):
                continue
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"sampling field {key!r} must be true or false")
            if kind is str and (not isinstance(value, str) or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"sampling field {key!r} must be a string of at most {MAX_GRAMMAR_CHARS} characters")
            if kind not in (bool, str) and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(f"sampling field {key!r} must be a number")
            fields[key] = value
        params = cls(**fields)
        params.validate()
        return params

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be between -2 and 2")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be between -2 and 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs and (self.logprobs is None or self.logprobs > MAX_PROMPT_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs needs logprobs between 0 and {MAX_PROMPT_TOP_LOGPROBS}")


DEFAULT = SamplingParams()
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "repetition_penalty": (int, float),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "seed": int,
    "logprobs": int,
    "prompt_logprobs": bool,
    "grammar": str,
}
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound)
MAX_PROMPT_TOP_LOGPROBS = 5  # alternatives per prompt token (OpenAI's completions bound; keeps the answer small)
MAX_PROMPT_LOGPROBS = 4096  # prompt tokens whose log-probabilities one answer carries
