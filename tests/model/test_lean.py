"""The lean path on a Hugging Face folder's float weights: packed weights and in-place KV buffers give the
transformers path's tokens.

The golden tests (`test_shard_golden`, `test_gemma_golden`, `test_gguf_architectures`) run GGUF shards on
the default path against transformers' `generate()`; these tests compare the two paths directly on the
embedded model as a folder of float32 safetensors (`embedded_folder`), with its float-weight options
(`--matmul openblas`, `--quant int8`), and check the buffers' bookkeeping.
"""

from dataclasses import replace

import pytest
import torch

from helpers import run_chain
from meshws.model.kernels import blas
from meshws.model.backend import DecodeStep
from meshws.model.kernels.native import kernels
from meshws.model.kv.kv_blocks import KV_BLOCK, LeanCache
from meshws.model.shard import ModelShard, ShardSettings
from meshws.tools.quality import greedy

pytestmark = pytest.mark.real_model

LEAN = ShardSettings(dtype="float32", compute="lean")  # float products on whichever library this CPU suits
PLAIN = ShardSettings(dtype="float32", compute="transformers")
needs_openblas = pytest.mark.skipif(blas.choose_matmul("openblas", "float32", False)[0] != "openblas",
                                    reason="numpy here does not multiply with OpenBLAS")


def _chat(shard, text):
    return shard.tokenize(shard.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False))


@pytest.fixture(scope="module")
def plain(embedded_folder):
    return ModelShard(embedded_folder, 0, 30, PLAIN)


def test_the_shard_says_which_path_it_runs(embedded_folder, plain):
    lean = ModelShard(embedded_folder, 20, 30, replace(LEAN, matmul="torch"))
    path = "lean llama, decode fused (meshws kernel)" if kernels() else "lean llama"
    assert lean.compute_path == path and plain.compute_path == "transformers"
    assert lean.compute_facts["path"] == path and lean.compute_facts["dtype"] == "float32"
    assert lean.compute_facts["attention"] == ("meshws kernel" if kernels() else "torch sdpa")
    assert plain.compute_facts["attention"] == "transformers"
    assert (lean.compute_facts["matmul"], plain.compute_facts["matmul"]) == ("torch", "torch")
    assert len(lean.model.model.layers) == 0, "transformers' copies of the layers are let go"
    assert lean.weight_bytes == 4 * lean.parameter_count()
    if blas.choose_matmul("openblas", "float32", False)[0] != "openblas":
        return  # numpy here has no OpenBLAS to multiply with (test_blas says so too)
    before = blas.threads()
    try:
        host = ModelShard(embedded_folder, 20, 30, replace(LEAN, matmul="openblas", threads=2))
        assert host.compute_path == "lean llama, OpenBLAS products" and host.compute_facts["matmul"] == "openblas"
        assert host.weight_bytes == 4 * host.parameter_count(), "the numpy views are the weights, not copies"
        assert (blas.threads(), torch.get_num_threads()) == (2, 1), "OpenBLAS gets the threads, torch keeps one"
    finally:
        blas.take_threads("torch", "", before)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("matmul", ["torch", pytest.param("openblas", marks=needs_openblas)])
@pytest.mark.parametrize("cuts", [(), (15,), (7, 19)], ids=["whole", "two", "three"])
def test_every_split_gives_the_transformers_tokens(embedded_folder, plain, cuts, matmul):
    bounds = [0, *cuts, 30]
    shards = [ModelShard(embedded_folder, a, b, replace(LEAN, matmul=matmul)) for a, b in zip(bounds, bounds[1:])]
    assert all(shard.compute_facts["matmul"] == matmul for shard in shards)
    ids = _chat(plain, "Explain in detail how a bicycle works.")
    want = run_chain([plain], ids, 24, "plain")
    assert run_chain(shards, ids, 24, "lean") == want
    assert all(shard.sessions.total_bytes == 0 for shard in shards)


def test_kv_blocks_grow_one_at_a_time_are_counted_and_released(embedded_model):
    shard = ModelShard(embedded_model, 0, 3, LEAN)  # a head of three layers: no LM head to pay for at every step
    per_position = 3 * 2 * 3 * 64 * 4  # layers x (keys, values) x kv heads x head dim x fp32
    shard.encode_prompt(list(range(1, 11)), session_id="s")
    entry = shard.sessions.lookup("s")
    assert isinstance(entry.cache, LeanCache) and entry.seq_len == 10
    assert shard.sessions.total_bytes == KV_BLOCK * per_position
    for step in range(2 * KV_BLOCK - 10 + 1):  # one position past the second block
        shard.encode_next_token(5 + step % 7, "s")
    assert entry.seq_len == 2 * KV_BLOCK + 1
    assert shard.sessions.total_bytes == entry.cache.nbytes == 3 * KV_BLOCK * per_position  # no room held beyond
    assert shard.release_session("s") and shard.sessions.total_bytes == 0


def test_growing_keeps_what_the_blocks_hold():
    cache = LeanCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    cache.reserve(3)
    cache.write(1, 0, torch.arange(12.0).view(1, 1, 3, 4), -torch.arange(12.0).view(1, 1, 3, 4))
    cache.length = 3
    first = cache.blocks[0]
    cache.reserve(KV_BLOCK + 1)
    assert cache.capacity == 2 * KV_BLOCK and cache.blocks[0] is first  # nothing copied
    assert torch.equal(cache.read(1, 3)[0], torch.arange(12.0).view(1, 1, 3, 4))
    assert torch.equal(cache.read(1, 3)[1], -torch.arange(12.0).view(1, 1, 3, 4))
    cache.crop_to(2)
    assert cache.length == 2


def test_a_cache_that_cannot_grow_is_left_as_it_was(monkeypatch):
    cache = LeanCache(layers=3, kv_heads=1, head_dim=4, dtype=torch.float32)
    cache.reserve(3)
    cache.write(2, 0, torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    cache.length = 3
    shared = cache.copy(3)
    made = []
    real = cache._new_block

    def new_block():
        if len(made) == 2:  # the third new block: no memory
            raise RuntimeError("out of memory")
        made.append(1)
        return real()

    monkeypatch.setattr(cache, "_new_block", new_block)
    with pytest.raises(RuntimeError):
        cache.reserve(2 * KV_BLOCK + 1)  # a copy of the shared block and two more
    assert cache.blocks == shared.blocks and cache.blocks[0].holders == 2
    assert torch.equal(cache.read(2, 3)[0], torch.ones(1, 1, 3, 4))


def test_a_fork_shares_blocks_until_one_writes_and_release_leaves_no_holders(embedded_model):
    shard = ModelShard(embedded_model, 0, 30, LEAN)
    prompt = list(range(1, 2 * KV_BLOCK + 20))
    shard.encode_prompt(prompt, session_id="a")
    whole = shard.sessions.total_bytes
    assert shard.fork_session("a", "b", 2 * KV_BLOCK + 5)
    assert shard.sessions.total_bytes == whole, "a fork holds no bytes of its own until it writes"
    a, b = (shard.sessions.lookup(sid).cache for sid in "ab")
    assert a.blocks == b.blocks and b.shared_positions == 2 * KV_BLOCK + 5
    block = whole // 3
    shard.encode_next_token(7, "b")  # position 2 KV_BLOCK + 5: the third block becomes b's own
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] is not a.blocks[2]
    assert shard.sessions.total_bytes == whole + block
    assert shard.release_session("a") and shard.sessions.total_bytes == 3 * block
    assert [blk.holders for blk in b.blocks] == [1, 1, 1]
    assert shard.release_session("b") and shard.sessions.total_bytes == 0


@pytest.mark.parametrize("quant", [None, "int8", "int8-fbgemm"])
def test_batched_lean_rows_equal_each_row_alone(embedded_model, embedded_folder, quant, monkeypatch):
    if quant == "int8-fbgemm":  # the int8 path where meshws's kernel cannot be built
        monkeypatch.setattr("meshws.model.shard_parts.kernels", lambda: None)
        quant = "int8"
    model = embedded_folder if quant else embedded_model  # (int8 is for float weights; a GGUF's blocks are its own)
    shard = ModelShard(model, 0, 30, ShardSettings(dtype="float32", compute="lean", quant=quant))
    assert shard.compute_path.endswith("(FBGEMM)" if quant and not shard.lean.native else "")
    texts = ["Hi", "Write a short story about a robot who learns to paint.", "What is 2 + 2?"]
    prompts = [_chat(shard, text) for text in texts]
    alone, batched = [], []
    for index, ids in enumerate(prompts):
        alone.append(run_chain([shard], ids, 12, f"alone-{index}"))
        batched.append([shard.encode_prompt(ids, session_id=f"row-{index}").token_id])
    for _ in range(11):
        steps = [DecodeStep(f"row-{index}", token_id=tokens[-1]) for index, tokens in enumerate(batched)]
        for tokens, result in zip(batched, shard.decode_batch(steps)):
            tokens.append(result.token_id)
    assert batched == alone
    for index in range(len(prompts)):
        shard.release_session(f"row-{index}")
    assert shard.sessions.total_bytes == 0


@pytest.mark.skipif(kernels() is None, reason="q8_0 keys and values need meshws's kernels")
def test_q8_0_keys_and_values_hold_17_64ths_of_float32_and_a_batch_decodes_as_each_alone(embedded_model):
    shard = ModelShard(embedded_model, 0, 30, replace(LEAN, kv_dtype="q8_0"))
    assert shard.compute_facts["kv_dtype"] == "q8_0"
    prompts = [list(range(1, 40)), list(range(7, 90)), list(range(3, 12))]
    firsts = [shard.encode_prompt(ids, session_id=f"s{index}").token_id for index, ids in enumerate(prompts)]
    blocks = sum(-(-len(ids) // KV_BLOCK) for ids in prompts)
    assert shard.sessions.total_bytes == blocks * KV_BLOCK * 30 * 2 * 3 * 68  # positions x layers x k, v x heads
    batched = shard.decode_batch([DecodeStep(f"s{index}", token_id=token) for index, token in enumerate(firsts)])
    for index, (ids, first) in enumerate(zip(prompts, firsts)):
        alone = shard.encode_prompt(ids + [first], session_id="alone").token_id
        assert batched[index].token_id == alone, "a row's q8_0 attention is the same alone as in a batch"
    for sid in ("s0", "s1", "s2", "alone"):
        shard.release_session(sid)
    assert shard.sessions.total_bytes == 0
    # Heads are turned on every path: torch's attention (a prompt) and `mw_attend` (steps) give the fused
    # kernel's tokens, and float32 keys and values' (a turn missed or not undone would not).
    prompt = _chat(shard, "What is the capital of France?")
    fused = greedy(shard, prompt, 8, "fused")
    assert fused == greedy(ModelShard(embedded_model, 0, 30, LEAN), prompt, 8, "float32")
    shard.lean.fused = None
    assert greedy(shard, prompt, 8, "unfused") == fused
    assert shard.sessions.total_bytes == 0
