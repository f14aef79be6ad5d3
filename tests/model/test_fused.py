"""The fused decode step (`fused.FusedDecode`): every layer of a Llama-style shard in one kernel call.

It must give the op-by-op lean path's tokens (which the golden tests tie to transformers'): on a GGUF's
blocks widened exactly (float32); on a folder's float weights in bfloat16 (rounding where torch's bf16
path rounds) and int8. (With 8-bit activations, the default on a GGUF, the smallest difference in a
value moves some of its roundings to 8 bits and the two paths soon part: what holds there, a row's
bits in any batch, is tested below, and their distance to the float32 oracle in `test_gguf_architectures`.)
A row's bits must not depend on the rows batched with it; what the kernel is handed is checked before
the C code reads it.
"""

import pytest
import torch

from meshws.model.kernels.native import kernels
from meshws.model.kv.kv_blocks import LeanCache
from meshws.model.text.sampling_params import SamplingParams
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(kernels() is None, reason="no C compiler: meshws's kernels cannot be built")]

PROMPTS = ["Count from 1 to 5.", "Write a short story about a robot who learns to paint."]


def _ids(shard, text):
    return shard.tokenize(shard.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False))


def _greedy(shard, ids, session, count, sampling=None):
    """Greedy tokens; with `sampling` asking for logprobs, each step's alternatives too."""
    results = [shard.encode_prompt(ids, session_id=session, sampling=sampling)]
    while len(results) < count:
        results.append(shard.encode_next_token(results[-1].token_id, session, sampling=sampling))
    shard.sessions.drop(session)
    tokens = [result.token_id for result in results]
    return (tokens, [dict(result.logprobs[0][1]) for result in results]) if sampling else tokens


BF16_STEP = 0.125  # nats: one bf16 step of a logit in [16, 32), where SmolLM2's top logits lie
MODELS = {"gguf": "embedded_model", "folder": "embedded_folder"}


def _parted_at_a_tie(one_call, op_by_op, alternatives):
    """Where bf16 paths part, the op-by-op path was torn: its top two logits within a step of bf16 rounding
    (torch's bf16 products sum in an order of their own on CPUs without bf16 instructions, so a tie goes either
    way), and the fused path took the other of the two. Beyond, the texts differ and are not compared."""
    parted = next((index for index, (a, b) in enumerate(zip(one_call, op_by_op)) if a != b), None)
    if parted is None:
        return True
    chosen = alternatives[parted]
    return one_call[parted] in chosen and chosen[op_by_op[parted]] - chosen[one_call[parted]] <= BF16_STEP


@pytest.mark.parametrize("model,settings", [
    ("gguf", ShardSettings(dtype="float32")), ("folder", ShardSettings(dtype="bfloat16")),
    ("folder", ShardSettings(dtype="float32", quant="int8"))], ids=["gguf-fp32", "folder-bf16", "folder-int8"])
def test_fused_decode_gives_the_op_by_op_tokens(request, model, settings):
    shard = ModelShard(request.getfixturevalue(MODELS[model]), 0, 30, settings)
    fused = shard.lean.fused
    assert fused is not None and "decode fused (meshws kernel)" in shard.compute_path
    assert shard.compute_facts["matmul"] == "torch" and "meshws's kernel" in shard.compute_facts["matmul_reason"]
    for index, text in enumerate(PROMPTS):
        ids = _ids(shard, text)
        shard.lean.fused = fused
        one_call = _greedy(shard, ids, f"fused-{index}", 24)
        shard.lean.fused = None  # the same packed weights, layer by layer through torch
        op_by_op, alternatives = _greedy(shard, ids, f"ops-{index}", 24, SamplingParams(temperature=0, logprobs=2))
        if settings.dtype != "float32":  # rounded (or quantized) alike: equal but at an exact or near tie
            assert _parted_at_a_tie(one_call, op_by_op, alternatives), (text, one_call, op_by_op)
        else:
            assert one_call == op_by_op, text
    shard.lean.fused = fused
    assert shard.sessions.total_bytes == 0 and len(shard.sessions) == 0


@pytest.mark.parametrize("model,settings", [
    ("gguf", ShardSettings(dtype="float32")), ("gguf", ShardSettings(dtype="auto")),
    ("folder", ShardSettings(dtype="bfloat16")), ("folder", ShardSettings(dtype="float32", quant="int8"))],
    ids=["gguf-fp32", "gguf-q8", "folder-bf16", "folder-int8"])
def test_a_rows_bits_do_not_depend_on_its_batch(request, model, settings):
    shard = ModelShard(request.getfixturevalue(MODELS[model]), 0, 12, settings)
    lean = shard.lean
    dtype = lean.dtype
    torch.manual_seed(0)
    lengths = [3, 40, 17]
    caches = []
    for length in lengths:  # caches of different lengths, filled by a prefill
        cache = lean.new_cache()
        lean.run(torch.randn(1, length, shard.hidden_size, dtype=dtype), torch.arange(length).unsqueeze(0), cache)
        caches.append(cache)
    rows = torch.randn(3, 1, shard.hidden_size, dtype=dtype)
    positions = torch.tensor([[length] for length in lengths])
    copies = [cache.copy(cache.length) for cache in caches]
    with torch.inference_mode():
        batched = lean.run_rows(rows, positions, caches)
        for index, copy in enumerate(copies):
            alone = lean.run_rows(rows[index : index + 1], positions[index : index + 1], [copy])
            assert torch.equal(alone, batched[index : index + 1])
            assert all(torch.equal(mine, theirs) for mine, theirs in zip(copy.read(5, lengths[index] + 1),
                                                                          caches[index].read(5, lengths[index] + 1)))
    assert [cache.length for cache in caches] == [length + 1 for length in lengths]


def test_what_the_kernel_is_handed_is_checked_first(embedded_model):
    shard = ModelShard(embedded_model, 0, 4, ShardSettings(dtype="float32"))
    fused, lean = shard.lean.fused, shard.lean
    cache = lean.new_cache()
    cache.reserve(8)
    hidden = torch.randn(1, 1, shard.hidden_size)
    cos, sin = lean.rope(torch.tensor([0]), 1)["full_attention"]
    with pytest.raises(ValueError):  # a row too many for the caches
        fused.run(torch.randn(2, 1, shard.hidden_size), cos, sin, [cache], [0], 1)
    with pytest.raises(ValueError):  # rotary tables of the wrong width
        fused.run(hidden, cos[:, :8], sin[:, :8], [cache], [0], 1)
    with pytest.raises(ValueError):  # a position past the cache's room
        fused.run(hidden, cos, sin, [cache], [cache.capacity], 1)
    with pytest.raises(ValueError):  # one session's cache twice in a step
        fused.run(torch.randn(2, 1, shard.hidden_size), cos.repeat(2, 1), sin.repeat(2, 1), [cache, cache], [0, 0], 1)
    with pytest.raises(ValueError):  # a cache of another shard's layer count
        fused.run(hidden, cos, sin, [LeanCache(3, lean.kv_heads, lean.head_dim, torch.float32)], [0], 1)
    out = fused.run(hidden, cos, sin, [cache], [0], 1)  # and after all that, a good step runs
    assert out.shape == hidden.shape and torch.isfinite(out).all()


def test_a_short_multi_token_step_runs_fused_as_rows_of_one_session(embedded_folder):
    """A lap of drafts (or a short prompt): its rows share one cache at consecutive positions, each seeing the
    keys of the rows before it, as the op-by-op path's causal attention does. (Float weights: a prompt longer than
    a fused step takes runs op by op; a GGUF's blocks run every prompt fused.)"""
    shard = ModelShard(embedded_folder, 0, 12, ShardSettings(dtype="float32"))
    lean, fused = shard.lean, shard.lean.fused
    calls = []
    lean.fused = type("Counting", (), {"run": lambda self, *args: calls.append(len(args[3])) or fused.run(*args)})()
    torch.manual_seed(1)
    prompt, lap = torch.randn(1, 80, shard.hidden_size), torch.randn(1, 5, shard.hidden_size)
    with torch.inference_mode():
        one_call, op_by_op = lean.new_cache(), lean.new_cache()
        lean.run(prompt, torch.arange(80).unsqueeze(0), one_call)  # longer than a fused step takes
        assert calls == []
        got = lean.run(lap, torch.arange(80, 85).unsqueeze(0), one_call)
        assert calls == [5] and one_call.length == 85
        lean.fused = None
        lean.run(prompt, torch.arange(80).unsqueeze(0), op_by_op)
        want = lean.run(lap, torch.arange(80, 85).unsqueeze(0), op_by_op)
    lean.fused = fused
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(one_call.read(11, 85)[0], op_by_op.read(11, 85)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(kernels() is None or not kernels().amx, reason="no AMX tiles on this CPU")
def test_bf16_on_amx_says_so_counts_its_tiles_and_batches_past_eight_rows_fused(embedded_folder):
    shard = ModelShard(embedded_folder, 20, 30, ShardSettings(dtype="bfloat16"))
    lean = shard.lean
    assert "bf16 products on AMX tiles" in shard.compute_path and lean.fused_rows >= 16
    assert lean.fused.head_tiles is not None  # the tail's LM head too
    # The tiles are a second copy of every bf16 matrix (torch's [out, in] stays for prefills): counted.
    assert lean.kept_bytes >= 2 * shard.parameter_count() * 0.95
    assert shard.weight_bytes >= 2 * 2 * shard.parameter_count() * 0.95
    caches = [lean.new_cache() for _ in range(16)]
    with torch.inference_mode():
        for cache in caches:  # four positions each, by a prefill
            lean.run(torch.randn(1, 4, shard.hidden_size, dtype=torch.bfloat16), torch.arange(4).unsqueeze(0), cache)
    calls = []
    fused = lean.fused
    lean.fused = type("Counting", (), {"run": lambda self, *args: calls.append(len(args[3])) or fused.run(*args)})()
    try:
        with torch.inference_mode():
            out = lean.run_rows(torch.randn(16, 1, shard.hidden_size, dtype=torch.bfloat16),
                                torch.full((16, 1), 4), caches)
        assert calls == [16] and out.shape == (16, 1, shard.hidden_size) and torch.isfinite(out.float()).all()
    finally:
        lean.fused = fused
