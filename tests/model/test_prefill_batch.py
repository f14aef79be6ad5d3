"""New sessions' prompts prefilled in one call (`batched.prefill_rows`) give what each prefill alone gives.

Real model, two shards in one process: the head prefills token ids, the tail hidden-state
bytes; on the GGUF's blocks with float32 and with 8-bit products, since the fused kernel's rows keep their
bits in any batch.
"""

import pytest
import torch

from meshws.model.backend import DecodeStep, PrefillStep, TailTokenResult, TensorPayload, run_prefill
from meshws.model.kv.cache_store import KVCacheMiss
from meshws.model.kernels.native import kernels
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(kernels() is None, reason="no C compiler: no fused kernel to batch prefills in")]

PROMPTS = ["Count from 1 to 5.", "Write a haiku about the sea.", "What is the capital of France? Answer briefly."]


def _ids(head, text):
    return head.tokenize(head.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                            add_generation_prompt=True, tokenize=False))


def _decode(head, tail, sid, *tokens, steps=6):
    tokens = list(tokens)
    while len(tokens) < steps:
        payload = head.decode_batch([DecodeStep(sid, token_id=tokens[-1])])[0]
        tokens.append(tail.decode_batch([DecodeStep(sid, body=payload.body, shape=payload.shape,
                                                    dtype=payload.dtype, past_len=payload.past_len)])[0].token_id)
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # (a GGUF's blocks: exact float32, or 8-bit products)
def test_prompts_prefilled_together_give_each_prompts_own_tokens_and_caches(embedded_model, dtype):
    head = ModelShard(embedded_model, 0, 15, ShardSettings(dtype=dtype))
    tail = ModelShard(embedded_model, 15, 30, ShardSettings(dtype=dtype))
    prompts = [_ids(head, text) for text in PROMPTS]
    alone, caches = [], []
    for index, ids in enumerate(prompts):  # one at a time, the path a lone prefill takes
        payload = run_prefill(head, PrefillStep(f"a{index}", token_ids=ids), 256)
        result = run_prefill(tail, PrefillStep(f"a{index}", body=payload.body, shape=payload.shape,
                                               dtype=payload.dtype), 256)
        cache = tail.sessions.lookup(f"a{index}").cache
        caches.append(cache.copy(cache.length))  # as the prefill left it (decoding grows it)
        alone.append((payload.body, _decode(head, tail, f"a{index}", result.token_id)))
    steps = [PrefillStep(f"b{index}", token_ids=ids) for index, ids in enumerate(prompts)]
    # (they may join where a call of several costs less than their calls apart: AMX tiles, a GGUF's blocks)
    assert [head.prefills_together(step) for step in steps] == [True] * len(steps)
    payloads = head.prefill_batch(steps + [PrefillStep("bad", token_ids=[head.vocab_size + 5])])
    assert isinstance(payloads[-1], ValueError) and "vocabulary" in str(payloads[-1])  # only that one fails
    assert "bad" not in head.sessions
    results = tail.prefill_batch([PrefillStep(f"b{index}", body=p.body, shape=p.shape, dtype=p.dtype)
                                  for index, p in enumerate(payloads[:-1])])
    for index, (payload, result) in enumerate(zip(payloads, results)):
        assert payload.body == alone[index][0], "the head's hidden states differ from the prompt's own"
        assert isinstance(result, TailTokenResult)
        cache = tail.sessions.lookup(f"b{index}").cache
        assert cache.length == caches[index].length == len(prompts[index])
        assert torch.equal(cache.read(3, cache.length)[0], caches[index].read(3, cache.length)[0])
        assert _decode(head, tail, f"b{index}", result.token_id) == alone[index][1]


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # (a GGUF's blocks: 8-bit products, or exact float32)
def test_decode_steps_that_ride_along_a_new_prompt_give_their_own_tokens(embedded_model, dtype):
    head = ModelShard(embedded_model, 0, 15, ShardSettings(dtype=dtype))
    tail = ModelShard(embedded_model, 15, 30, ShardSettings(dtype=dtype))
    prompts = [_ids(head, text) for text in PROMPTS]
    firsts = {}
    for sid, ids in (("x0", prompts[0]), ("x1", prompts[1]), ("y0", prompts[0]), ("y1", prompts[1]),
                     ("own", prompts[2])):
        payload = run_prefill(head, PrefillStep(sid, token_ids=ids), 256)
        firsts[sid] = run_prefill(tail, PrefillStep(sid, body=payload.body, shape=payload.shape,
                                                    dtype=payload.dtype), 256).token_id
    alone = [_decode(head, tail, f"x{index}", firsts[f"x{index}"]) for index in range(2)]
    # y0's and y1's first decode steps ride in the calls that prefill a new session's prompt, head and tail
    riders = [DecodeStep(f"y{index}", token_id=firsts[f"y{index}"]) for index in range(2)]
    *hidden, missing = head.prefill_batch([PrefillStep("new", token_ids=prompts[2])],
                                          riders + [DecodeStep("gone", token_id=5)])
    assert isinstance(missing, KVCacheMiss)  # a step at fault fails alone
    assert all(isinstance(payload, TensorPayload) for payload in hidden)
    prompt, *steps = hidden
    back = tail.prefill_batch([PrefillStep("new", body=prompt.body, shape=prompt.shape, dtype=prompt.dtype)],
                              [DecodeStep(f"y{index}", body=p.body, shape=p.shape, dtype=p.dtype, past_len=p.past_len)
                               for index, p in enumerate(steps)])
    assert back[0].token_id == firsts["own"]  # the prompt's own first token
    for index in range(2):
        assert _decode(head, tail, f"y{index}", firsts[f"y{index}"], back[1 + index].token_id) == alone[index]


def test_only_new_sessions_prompts_join(embedded_model):
    head = ModelShard(embedded_model, 0, 15, ShardSettings(dtype="auto"))
    ids = list(range(100, 120))
    assert head.prefills_together(PrefillStep("s", token_ids=ids))
    assert not head.prefills_together(PrefillStep(None, token_ids=ids))  # stateless
    assert not head.prefills_together(PrefillStep("s", token_ids=ids, mode="decode", past_len=4))  # a chunk
    assert not head.prefills_together(PrefillStep("s", token_ids=ids, drafts=[5]))


def test_float_weights_prompts_never_join(embedded_folder):  # arithmetic-bound: one call of five costs five
    shard = ModelShard(embedded_folder, 0, 2, ShardSettings(dtype="float32"))
    assert shard.lean.fused is not None and not shard.lean.on_blocks
    assert not shard.prefills_together(PrefillStep("s", token_ids=[100, 101]))
