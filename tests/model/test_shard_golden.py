"""Golden tests on real models: split shards produce exactly the tokens of the whole model.

The shards start from a cache of their own holding only the tokenizer (`fresh_model`) and map
their own tensors from the GGUF; the reference is the whole model loaded by transformers from
the same file, in float32.
"""

import pytest
import torch

from helpers import CHAT_PROMPTS
from meshws.model.shard import ModelShard, TailTokenResult

pytestmark = pytest.mark.real_model

STEPS = 32


def _chat_ids(head: ModelShard, text: str) -> list[int]:
    prompt = head.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return head.tokenize(prompt)


def _generate_ids(model, ids: list[int], steps: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps)
    return out[0, len(ids):].tolist()


def _run_chain(shards: list[ModelShard], ids: list[int], steps: int, session: str) -> list[int]:
    """Drive the chain in one process exactly as the mesh does: prefill, then one-token steps."""
    tokens: list[int] = []
    result = shards[0].encode_prompt(ids, session_id=session)
    mode = "prefill"
    while True:
        for shard in shards[1:]:
            result = shard.forward_bytes(
                result.body, result.shape,
                session_id=session, cache_mode=mode, past_len=result.past_len, dtype=result.dtype,
            )
        assert isinstance(result, TailTokenResult)
        tokens.append(result.token_id)
        if len(tokens) == steps:
            return tokens
        result = shards[0].encode_next_token(tokens[-1], session)
        assert result.shape[1] == 1, "decode payload must be a single token"
        mode = "decode"


def _run_stateless(shards: list[ModelShard], ids: list[int], steps: int) -> list[int]:
    """The seed's reference: re-run the whole sequence through every shard each step."""
    sequence = list(ids)
    for _ in range(steps):
        result = shards[0].encode_prompt(sequence)
        for shard in shards[1:]:
            result = shard.forward_bytes(result.body, result.shape, dtype=result.dtype)
        sequence.append(result.token_id)
    return sequence[len(ids):]


@pytest.fixture(scope="module")
def two_shards(fresh_model):
    return [ModelShard(fresh_model, 0, 15), ModelShard(fresh_model, 15, 30)]


@pytest.fixture(scope="module")
def three_shards(fresh_model):
    return [ModelShard(fresh_model, 0, 10), ModelShard(fresh_model, 10, 20), ModelShard(fresh_model, 20, 30)]


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_two_shard_split_matches_whole_model_generate(two_shards, reference_model, prompt):
    ids = _chat_ids(two_shards[0], prompt)
    golden = _generate_ids(reference_model, ids, STEPS)
    assert len(golden) == STEPS, "prompt should not hit EOS early, or the comparison is short"
    assert _run_chain(two_shards, ids, STEPS, session=f"two-{prompt[:8]}") == golden


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_three_shard_split_matches_whole_model_generate(three_shards, reference_model, prompt):
    ids = _chat_ids(three_shards[0], prompt)
    golden = _generate_ids(reference_model, ids, STEPS)
    assert _run_chain(three_shards, ids, STEPS, session=f"three-{prompt[:8]}") == golden


def test_cached_distributed_generation_matches_stateless_golden(two_shards):
    """The seed's golden test, not env-gated: cached decode == stateless re-encoding."""
    ids = _chat_ids(two_shards[0], "Count from 1 to 5.")
    steps = 12
    assert _run_chain(two_shards, ids, steps, session="golden-session") == _run_stateless(two_shards, ids, steps)


def test_full_shard_matches_generate_and_ties_embeddings(fresh_model, reference_model):
    full = ModelShard(fresh_model, 0, 30)
    # The tied matrix is the file's one tensor: the LM head reads the mapped embeddings, as the lookups do.
    assert full.lean.lm_head.blocks.name == "token_embd.weight"
    assert "output.weight" not in full.parts.gguf.handed_out
    ids = _chat_ids(full, CHAT_PROMPTS[0])
    tokens = [full.encode_prompt(ids, session_id="f").token_id]
    while len(tokens) < 16:
        tokens.append(full.encode_next_token(tokens[-1], "f").token_id)
    assert tokens == _generate_ids(reference_model, ids, 16)


def test_a_bfloat16_folder_split_matches_bfloat16_generate(embedded_folder):
    """A Hugging Face folder's float weights in bfloat16: the fused decode rounds where torch's bf16 path does."""
    from transformers import AutoModelForCausalLM

    from meshws.model.shard import ShardSettings

    settings = ShardSettings(dtype="bfloat16")
    shards = [ModelShard(embedded_folder, 0, 15, settings), ModelShard(embedded_folder, 15, 30, settings)]
    assert "GGUF" not in shards[0].compute_path
    reference = AutoModelForCausalLM.from_pretrained(str(embedded_folder.folder), dtype=torch.bfloat16)
    ids = _chat_ids(shards[0], CHAT_PROMPTS[1])
    assert _run_chain(shards, ids, 12, session="bf16") == _generate_ids(reference, ids, 12)


def test_shards_hold_only_their_own_weights(fresh_model):
    head = ModelShard(fresh_model, 0, 15)
    middle = ModelShard(fresh_model, 15, 20)
    tail = ModelShard(fresh_model, 15, 30)
    full = ModelShard(fresh_model, 0, 30)
    table = full.parts.gguf.table.tensors
    layer = {name.split(".", 2)[2] for name in table if name.startswith("blk.0.")}

    def span(first, last):
        return {f"blk.{index}.{rest}" for index in range(first, last) for rest in layer}

    assert middle.parts.gguf.handed_out == span(15, 20)
    assert tail.parts.gguf.handed_out == span(15, 30) | {"output_norm.weight", "token_embd.weight"}
    assert head.parts.gguf.handed_out == span(0, 15) | {"token_embd.weight"}
    assert full.parts.gguf.handed_out == set(table)
    assert head.tokenizer is not None and middle.tokenizer is None and tail.tokenizer is None
    # The bytes a node reports are its tensors' bytes in the file: mapped, never copied or widened.
    for shard in (head, middle, tail, full):
        assert shard.weight_bytes == sum(table[name].nbytes for name in shard.parts.gguf.handed_out)
        assert shard.memory()["weights_mapped_bytes"] == shard.weight_bytes
    per_layer = middle.parameter_count() / 5
    assert tail.parameter_count() == pytest.approx(15 * per_layer + 49152 * 576 + 576)
