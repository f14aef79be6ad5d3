"""Structured output on the tail: a grammar's mask on the logits before the sampler draws (llguidance).

The head turns `response_format` into an llguidance grammar (a JSON schema's) and
sends it in the session's sampling parameters; the tail, which samples, masks every
token the grammar does not allow at that point — in one-token steps, batched rows and
each row of a step with drafts alike, so a draft the grammar forbids is never what the
tail chooses and is rejected like any other. The state of the grammar is a function of
the tokens generated so far, which the tail holds (`history`): a matcher is kept under
the state it reached (`Grammars`) and found again by the session's next step; when none
is (a failover to this tail, a conversation cut back), one is rebuilt from the tokens.
Rejected drafts never enter a matcher: it advances only by the tokens the tail chose.
Why llguidance: see README ("Structured output").

A schema is tightened before it compiles, as llama.cpp's and xgrammar's grammars do, so
that a small model finishes its answer (docs/api.md, "Structured output"): an object
that declares properties takes no others unless the schema says `additionalProperties`;
a number is plain decimal with at most 15 digits before its point and 9 after; between
tokens goes at most one space, or one or two newlines and 20 spaces or tabs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

MAX_KEPT = 256  # matchers kept for the states sessions last reached
MAX_LAP_TOKENS = 17  # tokens one lap may add (16 drafts and one more): how far behind a kept matcher may be


class GrammarError(ValueError):
    """A grammar llguidance cannot use, or a token sequence it does not allow."""


MAX_INTEGER_PART = 10**15 - 1  # 15 digits before the point (llama.cpp's grammar allows 16)
FRACTION_STEP = 1e-9  # 9 digits after it: as `multipleOf`, which llguidance turns into a bound on the digits
WHITESPACE = r"( |\n{1,2}[ \t]{0,20})"  # between two tokens of JSON, once (llama.cpp's, one space fewer)
NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not schemas: left as they are
ANY = "meshws_any"  # the definition a bare object's values refer to: any JSON, its numbers bounded too


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object); GrammarError if it cannot be one."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            tightened(schema if schema is not None else {"type": "object"}),
            overrides={"whitespace_pattern": WHITESPACE})
    except Exception as exc:  # the library's own error types differ by version
        raise GrammarError(f"the schema cannot be compiled: {exc}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)  # None, or what is wrong
    if problem:
        raise GrammarError(f"the schema cannot be compiled: {problem}")
    return grammar


def tightened(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose objects take only the properties they declare and whose numbers are bounded."""
    used = [False]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: value if key in NOT_SCHEMAS else walk(value) for key, value in node.items()}
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False  # what the model would add is never what the client asked for
        elif "object" in types and not {"properties", "patternProperties", "additionalProperties"} & set(node):
            node["additionalProperties"] = {"$ref": f"#/$defs/{ANY}"}
            used[0] = True
        if "number" in types or "integer" in types:
            _bound_number(node)
        return node

    out = walk(schema)
    if used[0] and isinstance(out, dict):
        out["$defs"] = {**(out.get("$defs") or {}), ANY: _any_json()}
    return out


def _bound_number(node: dict[str, Any]) -> None:
    """At most MAX_INTEGER_PART in size (within the schema's own bounds) and, for a number, 9 digits after its
    point; a schema that asks for larger numbers keeps its own bounds."""
    low, high = _numeric(node.get("minimum")), _numeric(node.get("maximum"))
    if (low is not None and low > MAX_INTEGER_PART) or (high is not None and high < -MAX_INTEGER_PART):
        return
    node["minimum"] = -MAX_INTEGER_PART if low is None else max(low, -MAX_INTEGER_PART)
    node["maximum"] = MAX_INTEGER_PART if high is None else min(high, MAX_INTEGER_PART)
    types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    if "number" in types and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP


def _numeric(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _any_json() -> dict[str, Any]:
    """Any JSON value, its numbers and nested objects bounded as the rest of the schema's."""
    ref = {"$ref": f"#/$defs/{ANY}"}
    number = {"type": "number"}
    _bound_number(number)
    return {"anyOf": [{"type": "null"}, {"type": "boolean"}, number, {"type": "string"},
                      {"type": "array", "items": ref}, {"type": "object", "additionalProperties": ref}]}


class Matcher:
    """A grammar's state after some tokens: which tokens may come next, and advancing by one."""

    def __init__(self, inner: Any, vocab_size: int) -> None:
        import llguidance.torch

        self._inner = inner
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.consumed: list[int] = []

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf, in place (one row, `[vocab]`)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._inner, self._bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits.unsqueeze(0), self._bitmask)

    def advance(self, token: int) -> None:
        if not self._inner.consume_token(int(token)):
            raise GrammarError(f"the grammar does not allow token {token} here: {self._inner.get_error()}")
        self.consumed.append(int(token))



class Grammars:
    """The matchers of a tail, each kept under the state it reached (grammar, tokens consumed): a session's
    next step finds its own, however many sessions share the grammar."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = tokenizer  # the head's, or loaded at a tail's first grammar
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._kept: OrderedDict[tuple[str, tuple[int, ...]], Matcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str, generated: Sequence[int]) -> Matcher:
        """A matcher that has consumed exactly `generated`: one kept a lap or less behind it, else a new one."""
        generated = tuple(int(t) for t in generated)
        matcher = None
        with self._lock:
            for behind in range(min(len(generated), MAX_LAP_TOKENS) + 1):  # the last lap's tokens are new to it
                matcher = self._kept.pop((grammar, generated[: len(generated) - behind]), None)
                if matcher is not None:
                    break
        matcher = matcher or self._new(grammar)
        for token in generated[len(matcher.consumed):]:
            matcher.advance(token)
        return matcher

    def keep(self, grammar: str, matcher: Matcher) -> None:
        """Remember where `matcher` is now, for the session's next step."""
        with self._lock:
            self._kept[(grammar, tuple(matcher.consumed))] = matcher
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)

    def _new(self, grammar: str) -> Matcher:
        import llguidance

        if self._tokenizer is None:  # (as llguidance.hf reads a fast tokenizer, without importing transformers)
            from .plain_tokenizer import guidance_source

            tokenizer = self._load_tokenizer()
            if getattr(tokenizer, "backend_tokenizer", None) is None:
                raise GrammarError("structured output needs a fast tokenizer (a tokenizer.json); this model's is not")
            self._tokenizer = llguidance.LLTokenizer(guidance_source(tokenizer), n_vocab=self.vocab_size,
                                                     eos_token=tokenizer.eos_token_id)
        inner = llguidance.LLMatcher(self._tokenizer, grammar)
        if inner.is_error():
            raise GrammarError(f"the grammar cannot be used: {inner.get_error()}")
        return Matcher(inner, self.vocab_size)
