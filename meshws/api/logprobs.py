"""Log-probabilities in the shapes OpenAI clients read: chat's `content` list, completions' four lists.

The tail computes them (`sampling.token_logprobs`: the sampler's distribution after
penalties and temperature, before top-k/top-p); here each token id becomes its text (a
token that is part of a multi-byte character shows U+FFFD, its `bytes` those of that text).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..model.backend import TokenLogprob

Decode = Callable[[Sequence[int]], str]
Entries = Sequence[tuple[int, TokenLogprob]]  # (token id, (its logprob, alternatives))


def _remembered(decode: Decode) -> Callable[[list[int]], str]:
    """`decode` of one token id, each id decoded once (an answer's alternatives repeat the same few tokens)."""
    texts: dict[int, str] = {}

    def one(ids: list[int]) -> str:
        if len(ids) != 1:
            return decode(ids)
        if ids[0] not in texts:
            texts[ids[0]] = decode(ids)
        return texts[ids[0]]

    return one


def chat_logprobs(entries: Entries, decode: Decode) -> dict[str, Any]:
    """`choice.logprobs` of a chat answer (or of one streamed chunk)."""
    decode = _remembered(decode)

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(token, logprob), "top_logprobs": [one(alt, value) for alt, value in top]}
                        for token, (logprob, top) in entries], "refusal": None}


def completion_logprobs(entries: Entries, decode: Decode, offset: int = 0) -> dict[str, Any]:
    """`choice.logprobs` of a completion (or of one streamed chunk); `offset`: where its text starts."""
    decode = _remembered(decode)
    tokens, offsets = [], []
    for token, _ in entries:
        tokens.append(decode([token]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, (logprob, _) in entries],
        "top_logprobs": [{decode([alt]): value for alt, value in top} for _, (_, top) in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(prompt_ids: Sequence[int], reported: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """The echoed prompt's part of a completion's `logprobs`: its first token has none (null), as OpenAI's."""
    shaped = completion_logprobs(list(zip(prompt_ids[1:], reported)), decode)
    first = decode(prompt_ids[:1])
    offsets = [0] + [offset + len(first) for offset in shaped["text_offset"]]
    return {"tokens": [first, *shaped["tokens"]], "token_logprobs": [None, *shaped["token_logprobs"]],
            "top_logprobs": [None, *shaped["top_logprobs"]], "text_offset": offsets}


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two parts of a completion's `logprobs` one after the other (`then`'s offsets already count `first`)."""
    return {key: [*first[key], *then[key]] for key in first}
