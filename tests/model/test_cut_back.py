"""A step whose `past_len` is shorter than the session's cache cuts the cache back first.

This is what lets a conversation's next turn prefill only what is new: the shards keep
the session, the head sends the new tokens at the length both turns share, and every
shard drops the positions after it. The text must be what a fresh prefill gives.
"""

import pytest

from helpers import run_chain
from meshws.model.backend import DecodeStep, PrefillStep
from meshws.model.kv.cache_store import KVCacheMiss
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = pytest.mark.real_model


def _drain(run):
    """Run a chunked prefill generator to its result."""
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def _turn(shards, session, ids, past_len, steps):
    """Tokens after `ids`, reusing the first `past_len` positions the chain's caches hold."""
    head, *rest = shards
    mode = "decode" if past_len else "prefill"
    result = _drain(head.prefill(PrefillStep(session, token_ids=ids[past_len:], mode=mode, past_len=past_len), 4))
    tokens = []
    while True:
        for shard in rest:
            result = _drain(shard.prefill(PrefillStep(session, body=result.body, shape=result.shape,
                                                      dtype=result.dtype, mode=mode, past_len=result.past_len), 4)) \
                if result.shape[1] > 1 else shard.forward_bytes(result.body, result.shape, dtype=result.dtype,
                                                                 session_id=session, cache_mode="decode",
                                                                 past_len=result.past_len)
        mode = "decode"
        tokens.append(result.token_id)
        if len(tokens) == steps:
            return tokens
        result = head.encode_next_token(tokens[-1], session)


@pytest.mark.parametrize("compute", ["lean", "transformers"])
def test_a_shorter_past_len_cuts_every_cache_back(embedded_model, compute):
    settings = ShardSettings(dtype="float32", compute=compute)
    shards = [ModelShard(embedded_model, 0, 15, settings), ModelShard(embedded_model, 15, 30, settings)]
    first = shards[0].tokenize("The capital of France is Paris. The capital of Spain is")
    second = shards[0].tokenize("The capital of France is Paris. The tallest mountain is")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert 3 < shared < len(second) - 1
    want = run_chain(shards, second, 6, "fresh")

    _turn(shards, "s", first, 0, 3)
    _turn(shards, "s", first, len(first) - 1, 1)  # a one-position step: the cache is cut back by three
    assert all(shard.sessions.lookup("s").seq_len == len(first) for shard in shards)
    assert _turn(shards, "s", second, shared, 6) == want
    assert all(shard.sessions.lookup("s").seq_len == len(second) + 5 for shard in shards)

    # a batched decode step cuts back too: the regenerated answer's first token again
    head, tail = shards
    payload = head.prefill(PrefillStep("s", token_ids=second[-1:], mode="decode", past_len=len(second) - 1), 4)
    payload = _drain(payload)
    other = _drain(head.prefill(PrefillStep("t", token_ids=second), 4))
    _drain(tail.prefill(PrefillStep("t", body=other.body, shape=other.shape, dtype=other.dtype), 4))
    step = _drain(head.prefill(PrefillStep("t", token_ids=[want[0]], mode="decode", past_len=len(second)), 4))
    results = tail.decode_batch([
        DecodeStep("s", body=payload.body, shape=payload.shape, dtype=payload.dtype, past_len=len(second) - 1),
        DecodeStep("t", body=step.body, shape=step.shape, dtype=step.dtype, past_len=len(second)),
    ])
    assert [result.token_id for result in results] == want[:2]
    assert tail.sessions.lookup("s").seq_len == len(second)


def test_a_longer_past_len_is_still_a_miss(embedded_model):
    shard = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32"))
    ids = shard.tokenize("Hello there, how are you?")
    shard.encode_prompt(ids, session_id="s")
    with pytest.raises(KVCacheMiss):
        _drain(shard.prefill(PrefillStep("s", token_ids=[5, 6], mode="decode", past_len=len(ids) + 1), 4))
    assert "s" not in shard.sessions


@pytest.mark.parametrize("compute", ["lean", "transformers"])
def test_a_fork_copies_the_first_positions_and_goes_on_alone(embedded_model, compute):
    """`n` choices: a second session starts as a copy of the first's prompt (less its last token); fed that
    token it chooses what the first chose, and each goes on without touching the other's cache."""
    shard = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", compute=compute))
    prompt = shard.tokenize("The three primary colours are")
    first = shard.encode_prompt(prompt, "parent").token_id
    assert shard.fork_session("parent", "child", len(prompt) - 1)
    assert shard.sessions.held("child") == len(prompt) - 1
    assert shard.run_tokens([prompt[-1]], "child", "decode", len(prompt) - 1).token_id == first
    parent_next = shard.encode_next_token(first, "parent").token_id
    assert shard.encode_next_token(first, "child").token_id == parent_next  # same greedy path, separate caches
    assert shard.sessions.held("parent") == shard.sessions.held("child") == len(prompt) + 1
    assert not shard.fork_session("nobody", "orphan", 3) and "orphan" not in shard.sessions
    assert not shard.fork_session("parent", "too-long", 10_000)
