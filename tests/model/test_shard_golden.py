"""Golden tests on real models: split shards produce exactly the tokens of the whole model.

The shards start from a cache of their own holding only the config and tokenizer
(`fresh_model`), so each converts only its span; the reference is the whole model
loaded by transformers.
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
    # One copy of the tied matrix: the lean path's packed LM head, which the embeddings read too.
    assert full.lean.lm_head[0].data_ptr() == full.model.model.embed_tokens.weight.data_ptr()
    ids = _chat_ids(full, CHAT_PROMPTS[0])
    tokens = [full.encode_prompt(ids, session_id="f").token_id]
    while len(tokens) < 16:
        tokens.append(full.encode_next_token(tokens[-1], "f").token_id)
    assert tokens == _generate_ids(reference_model, ids, 16)


def test_bfloat16_split_matches_bfloat16_generate(fresh_model, reference_model):
    from transformers import AutoModelForCausalLM

    from meshws.model.shard import ShardSettings

    settings = ShardSettings(dtype="bfloat16")
    shards = [ModelShard(fresh_model, 0, 15, settings), ModelShard(fresh_model, 15, 30, settings)]
    assert {path.name for path in (fresh_model.folder / "bfloat16").iterdir()} >= {"model.layers.0.safetensors"}
    reference = AutoModelForCausalLM.from_pretrained(reference_model.name_or_path, dtype=torch.bfloat16)
    ids = _chat_ids(shards[0], CHAT_PROMPTS[1])
    assert _run_chain(shards, ids, 12, session="bf16") == _generate_ids(reference, ids, 12)


def test_shards_hold_only_their_own_weights(fresh_model):
    head = ModelShard(fresh_model, 0, 15)
    middle = ModelShard(fresh_model, 15, 20)
    tail = ModelShard(fresh_model, 15, 30)
    full = ModelShard(fresh_model, 0, 30)
    embedding = full.model.model.embed_tokens.weight.numel()
    decoder_total = full.parameter_count() - embedding - full.model.model.norm.weight.numel()
    per_layer = decoder_total / 30
    # The tail: 15 layers + final norm + LM head (the tied embedding matrix), nothing else.
    tail_decoder = tail.parameter_count() - embedding - tail.model.model.norm.weight.numel()
    assert tail_decoder == pytest.approx(15 * per_layer)
    assert tail.model.model.embed_tokens is None
    assert middle.parameter_count() == pytest.approx(5 * per_layer)
    assert middle.model.lm_head is None and middle.model.model.embed_tokens is None
    assert head.parameter_count() == pytest.approx(embedding + 15 * per_layer)
    assert head.tokenizer is not None and middle.tokenizer is None and tail.tokenizer is None
    # The bytes a node reports: its own weights (a tied matrix once), in the compute dtype, and the copies its fused
    # decode reads (a Q4_1 GGUF's layers and its Q8_0 LM head as their codes: `blocks`), nothing else.
    for shard in (tail, full):
        linears = [packed for layer in shard.lean.layers for packed in layer.linears()] + [shard.lean.lm_head]
        codes = sum(packed.blocks.nbytes for packed in linears if packed.blocks is not None)
        assert shard.weight_bytes == 4 * shard.parameter_count() + codes
    assert 0.45 < tail.weight_bytes / full.weight_bytes < 0.65


def test_bad_layer_range_and_bad_bytes_are_refused(two_shards, fresh_model):
    with pytest.raises(ValueError, match="not within"):
        ModelShard(fresh_model, 10, 31)
    tail = two_shards[1]
    with pytest.raises(ValueError, match="needs"):
        tail.forward_bytes(b"\x00" * 10, [1, 1, 576])
    with pytest.raises(ValueError, match="shape"):
        tail.forward_bytes(b"\x00" * 1152, [1, 1, 288, 2])
    with pytest.raises(ValueError, match="cache mode"):
        tail.forward_bytes(b"\x00" * 1152, [1, 1, 576], session_id="s", cache_mode="sideways")


def test_cache_miss_on_decode_without_prefill(two_shards):
    from meshws.model.cache_store import KVCacheMiss

    with pytest.raises(KVCacheMiss):
        two_shards[1].forward_bytes(b"\x00" * 1152, [1, 1, 576],
                                    session_id="never-opened", cache_mode="decode", past_len=5)
    with pytest.raises(KVCacheMiss):
        two_shards[0].encode_next_token(5, "never-opened")


def test_release_session_drops_cache_bytes(two_shards):
    head, tail = two_shards
    ids = _chat_ids(head, "hello")
    _run_chain(two_shards, ids, 3, session="release-me")
    assert "release-me" in head.sessions and tail.sessions.total_bytes > 0
    assert head.release_session("release-me") and tail.release_session("release-me")
    assert "release-me" not in tail.sessions


def test_chunked_prefill_extends_the_cache(two_shards, reference_model):
    """A prefill sent in two chunks (prefill + decode-with-many-tokens) gives the same tokens."""
    head, tail = two_shards
    ids = _chat_ids(head, CHAT_PROMPTS[2])
    golden = _generate_ids(reference_model, ids, 8)
    half = len(ids) // 2
    first = head.encode_prompt(ids[:half], session_id="chunk")
    tail.forward_bytes(first.body, first.shape, session_id="chunk", cache_mode="prefill", dtype=first.dtype)
    # The head extends its own cache by running the second chunk as a multi-token step.
    second = head.run_tokens(ids[half:], "chunk", "decode", half)
    result = tail.forward_bytes(second.body, second.shape, session_id="chunk",
                                cache_mode="decode", past_len=half, dtype=second.dtype)
    tokens = [result.token_id]
    while len(tokens) < 8:
        step = head.encode_next_token(tokens[-1], "chunk")
        tokens.append(tail.forward_bytes(step.body, step.shape, session_id="chunk",
                                         cache_mode="decode", past_len=step.past_len, dtype=step.dtype).token_id)
    assert tokens == golden
