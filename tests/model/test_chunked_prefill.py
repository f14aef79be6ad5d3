"""A long prefill in chunks gives the tokens of one prefill; failures in a batch stay in their own row.

Real model, fp32 on the wire and in compute, two shards in one process, driven the way
the mesh drives them (the compute worker resumes a `prefill` once per chunk).
"""

import pytest
import torch

from meshws.model.backend import DecodeStep, PrefillStep, TailTokenResult, run_prefill
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = pytest.mark.real_model

EXACT = ShardSettings(dtype="float32", wire_dtype="float32")
STEPS = 12


@pytest.fixture(scope="module")
def shards(embedded_model):
    return [ModelShard(embedded_model, 0, 15, EXACT), ModelShard(embedded_model, 15, 30, EXACT)]


def _long_ids(head: ModelShard) -> list[int]:
    text = "Here is a list of fruits and what they taste like. " * 40 + "Which fruit is the sweetest?"
    ids = head.tokenize(text)
    assert len(ids) > 400
    return ids


def _prefill(shard, step, chunk):
    """Run every chunk of the step, counting the pauses between chunks."""
    run, pauses = shard.prefill(step, chunk), 0
    while True:
        try:
            next(run)
            pauses += 1
        except StopIteration as done:
            return done.value, pauses


def _generate(shards, ids, chunk, sid):
    head, tail = shards
    tokens, pauses = [], []
    payload, paused = _prefill(head, PrefillStep(sid, token_ids=ids), chunk)
    pauses.append(paused)
    result, paused = _prefill(tail, PrefillStep(sid, body=payload.body, shape=payload.shape, dtype=payload.dtype,
                                                past_len=payload.past_len), chunk)
    pauses.append(paused)
    while True:
        assert isinstance(result, TailTokenResult)
        tokens.append(result.token_id)
        if len(tokens) == STEPS:
            return tokens, pauses
        payload = head.encode_next_token(tokens[-1], sid)
        result = tail.forward_bytes(payload.body, payload.shape, dtype=payload.dtype, session_id=sid,
                                    cache_mode="decode", past_len=payload.past_len)


def test_chunked_prefill_gives_the_tokens_of_one_prefill(shards):
    ids = _long_ids(shards[0])
    whole, whole_pauses = _generate(shards, ids, chunk=10_000, sid="whole")
    chunked, chunked_pauses = _generate(shards, ids, chunk=128, sid="chunked")
    assert whole_pauses == [0, 0]
    expected_pauses = -(-len(ids) // 128) - 1
    assert chunked_pauses == [expected_pauses, expected_pauses]  # ceil(n / 128) chunks on each shard
    assert chunked == whole
    for shard in shards:
        assert shard.sessions.lookup("chunked").seq_len == shard.sessions.lookup("whole").seq_len
        shard.release_session("whole")
        shard.release_session("chunked")


def test_a_chunk_that_extends_a_cache_at_past_len_matches_too(shards):
    """A multi-token step at past_len (draft verification, a conversation's next turn) chunks the same way."""
    head, tail = shards
    ids = _long_ids(head)
    split = 300
    answers = []
    for sid, chunk in (("one", 10_000), ("many", 64)):
        run_prefill(head, PrefillStep(sid, token_ids=ids[:split]), chunk)
        first = run_prefill(head, PrefillStep(sid, token_ids=ids[:split]), chunk)  # a re-prefill replaces
        second = run_prefill(head, PrefillStep(sid, token_ids=ids[split:], mode="decode", past_len=split), chunk)
        assert head.sessions.lookup(sid).seq_len == len(ids)
        run_prefill(tail, PrefillStep(sid, body=first.body, shape=first.shape, dtype=first.dtype), chunk)
        answers.append(run_prefill(tail, PrefillStep(sid, body=second.body, shape=second.shape, dtype=second.dtype,
                                                     mode="decode", past_len=split), chunk).token_id)
        head.release_session(sid)
        tail.release_session(sid)
    assert answers[0] == answers[1]


def test_a_token_id_outside_the_vocabulary_fails_only_its_row(shards):
    head = shards[0]
    for index in range(3):
        head.encode_prompt([1, 2, 3 + index], session_id=f"row-{index}")
    steps = [DecodeStep("row-0", token_id=5), DecodeStep("row-1", token_id=head.vocab_size + 7),
             DecodeStep("row-2", token_id=6)]
    results = head.decode_batch(steps)
    assert isinstance(results[1], ValueError) and "vocabulary" in str(results[1])
    assert results[0].shape == [1, 1, 576] and results[2].shape == [1, 1, 576]
    with pytest.raises(ValueError, match="vocabulary"):
        head.encode_prompt([1, -3, 2], session_id="bad")
    assert head.supports_kv_cache and "bad" not in head.sessions
    for index in range(3):
        head.release_session(f"row-{index}")


def test_a_batch_that_raises_is_undone_and_its_rows_run_alone(shards, monkeypatch):
    """A failing batched forward (here a MemoryError) never turns batching or caching off."""
    head = shards[0]
    assert head.supports_batching
    for index in range(2):
        head.encode_prompt([1, 2, 3], session_id=f"alone-{index}")
        head.encode_prompt([1, 2, 3], session_id=f"batch-{index}")
    expected = [head.encode_next_token(9, f"alone-{index}") for index in range(2)]
    real_run = head.rows.run_rows

    def run_then_fail(hidden, positions, caches):
        real_run(hidden, positions, caches)  # every cache now holds one position too many
        raise MemoryError("test: no memory for the batch")

    monkeypatch.setattr(head.rows, "run_rows", run_then_fail)
    results = head.decode_batch([DecodeStep(f"batch-{index}", token_id=9) for index in range(2)])
    assert not any(isinstance(r, Exception) for r in results), results
    for got, want in zip(results, expected):
        assert torch.equal(torch.frombuffer(bytearray(got.body), dtype=torch.float32),
                           torch.frombuffer(bytearray(want.body), dtype=torch.float32))
    assert head.supports_batching and head.supports_kv_cache
    assert [head.sessions.lookup(f"batch-{index}").seq_len for index in range(2)] == [4, 4]
    for index in range(2):
        head.release_session(f"alone-{index}")
        head.release_session(f"batch-{index}")


def test_between_chunks_a_tail_holds_no_earlier_chunks_rows(shards):
    """A tail answers from the last row of the last chunk, so while a long prompt pauses between chunks it keeps no
    chunk's hidden rows (a slice of each had kept its whole chunk alive: 2 MB a chunk of SmolLM2's float32 rows, 10 MB
    for each 1,500-token prompt in flight on a 1B node); the head keeps its rows, which it sends on whole."""
    head, tail = shards
    ids = _long_ids(head)
    held = {}
    payload = None
    for shard, step in ((head, PrefillStep("held", token_ids=ids)), (tail, None)):
        if step is None:
            step = PrefillStep("held", body=payload.body, shape=payload.shape, dtype=payload.dtype)
        run = shard.prefill(step, 128)
        next(run), next(run)  # two chunks run, paused before the third
        held[shard.is_tail] = sum(out.numel() for out in run.gi_frame.f_locals["outputs"])
        payload = run_prefill(shard, step, 10_000) if not shard.is_tail else None
        run.close()
        shard.release_session("held")
    assert held == {False: 2 * 128 * head.hidden_size, True: 0}
