"""The architectures people download, on their GGUF's blocks: tiny synthetic files (`synth_gguf`) through a 2-shard
split against transformers loading the same file in float32.

With `--dtype float32` the greedy tokens are transformers' and the prompt's log-probabilities agree within 1e-3 a
token; with the default 8-bit activations the log-probabilities stay within what 8-bit activations cost (llama.cpp,
which multiplies the same way, lands at the same distance from the same oracle: `python -m meshws.bench`).
"""

from pathlib import Path

import pytest
import torch

from helpers import run_chain
from meshws.model.settings import ShardSettings
from meshws.model.shard import ModelShard
from meshws.tools.synth_gguf import write

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a"]
EXACT = ShardSettings(dtype="float32", wire_dtype="float32")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    return {name: Path(write(str(folder / f"{name}.gguf"), "tiny", arch, quant, rope_freqs=rope))
            for name, arch, quant, rope in (("llama", "llama", "q4_k_m", False), ("qwen2", "qwen2", "q4_k_m", False),
                                            ("qwen3", "qwen3", "q4_k_m", False), ("mixed", "llama", "mixed", False),
                                            ("llama3", "llama", "q4_k_m", True))}


def _reference(path, rope_parameters=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    if rope_parameters:  # a GGUF carries Llama 3's rope as factors (`rope_freqs`), which transformers' loader drops
        from transformers import AutoConfig

        config = AutoConfig.for_model(**{**model.config.to_dict(), "rope_parameters": rope_parameters})
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def _prompt_logprobs(model_or_shard, ids):
    with torch.inference_mode():
        if isinstance(model_or_shard, ModelShard):
            shard = model_or_shard
            hidden = shard.layers.run(shard.embed(ids), torch.arange(len(ids)).unsqueeze(0), "lp", "prefill", 0)
            logits = shard.last_logits(hidden, len(ids))
            shard.release_session("lp")
        else:
            logits = model_or_shard(torch.tensor([ids])).logits[0]
    chosen = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    return chosen[:, 0]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mixed"])
def test_a_split_gives_transformers_tokens_and_logprobs_in_float32(files, name):
    path = files[name]
    reference = _reference(path)
    shards = [ModelShard(str(path), 0, 2, EXACT), ModelShard(str(path), 2, 4, EXACT)]
    assert all(shard.compute_path.startswith(f"lean {'llama' if name != 'mixed' else 'llama'}, GGUF blocks")
               for shard in shards)
    whole = ModelShard(str(path), 0, 4, EXACT)
    for prompt in PROMPTS:
        ids = shards[0].tokenize(prompt)
        with torch.inference_mode():
            golden = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):]
        assert run_chain(shards, ids, 12, f"split-{prompt[:6]}") == golden.tolist()
        assert (_prompt_logprobs(whole, ids) - _prompt_logprobs(reference, ids)).abs().max() < 1e-3


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_8_bit_activations_stay_near_the_float32_oracle_and_a_split_gives_the_whole_models_tokens(files, name):
    """Measured on these files over 131 tokens of six texts: meshws mean 0.057 / 0.034 nats from the oracle (max
    0.25 / 0.14), llama.cpp 0.057 / 0.037 (max 0.37 / 0.17)."""
    path = files[name]
    reference = _reference(path)
    whole = ModelShard(str(path), 0, 4, ShardSettings(dtype="auto"))
    assert "8-bit activations" in whole.compute_path
    shards = [ModelShard(str(path), 0, 2, ShardSettings(dtype="auto", wire_dtype="float32")),
              ModelShard(str(path), 2, 4, ShardSettings(dtype="auto"))]
    errors = []
    for prompt in PROMPTS:
        ids = whole.tokenize(prompt)
        errors.append((_prompt_logprobs(whole, ids) - _prompt_logprobs(reference, ids)).abs())
        # A split computes every row as the whole model does: the same tokens, by design.
        assert run_chain(shards, ids, 12, f"q8-{prompt[:6]}") == run_chain([whole], ids, 12, f"q8w-{prompt[:6]}")
    errors = torch.cat(errors)
    assert errors.max() < 0.6 and errors.mean() < 0.1


def test_llama_3_rope_frequencies_are_applied_as_llama_cpp_applies_them(files):
    """`rope_freqs.weight` divides the rotary frequencies: transformers' Llama 3 rope parameters give the same."""
    path = files["llama3"]
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    reference, plain = _reference(path, llama3), _reference(path)
    shard = ModelShard(str(path), 0, 4, EXACT)
    assert shard.parts.gguf.table.tensors["rope_freqs.weight"]
    ids = shard.tokenize(PROMPTS[2] + " " + PROMPTS[1])
    with torch.inference_mode():
        golden = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):]
    assert run_chain([shard], ids, 12, "llama3") == golden.tolist()
    ours = _prompt_logprobs(shard, ids)
    assert (ours - _prompt_logprobs(reference, ids)).abs().max() < 1e-3
    assert (ours - _prompt_logprobs(plain, ids)).abs().max() > 1e-2, "the factors change the model"


def test_a_type_the_kernels_lack_runs_dequantized_and_says_so(tmp_path, files):
    """A GGUF with an IQ2_XXS tensor: the transformers path on weights dequantized in memory, named in the path; asked
    for the lean path, a clear error naming the types it computes on."""
    import gguf
    import numpy as np

    from meshws.model.gguf.gguf_file import read_table

    source = read_table(files["llama"].as_posix())
    path = tmp_path / "with-iq2xxs.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    original = gguf.GGUFReader(str(files["llama"]))
    for field in original.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    for tensor in original.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.1.ffn_up.weight":  # IQ2_XXS: 66 bytes a block of 256, its scale d a float16 first
            rows, columns = int(tensor.shape[1]), int(tensor.shape[0])
            blocks = np.random.default_rng(0).integers(0, 256, size=(rows * columns // 256, 66), dtype=np.uint8)
            blocks[:, 0:2] = np.array([1e-4], dtype=np.float16).view(np.uint8)
            writer.add_tensor(tensor.name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
            continue
        raw = None if tensor.tensor_type == gguf.GGMLQuantizationType.F32 else tensor.tensor_type
        writer.add_tensor(tensor.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    assert read_table(path).tensors["blk.1.ffn_up.weight"].ggml_type == 16 and source
    shard = ModelShard(str(path), 0, 4, EXACT)
    assert shard.compute_path.startswith("transformers (weights dequantized in memory: its tensors include IQ2_XXS")
    assert shard.encode_prompt(shard.tokenize(PROMPTS[0])).token_id >= 0
    with pytest.raises(ValueError, match="IQ2_XXS; the kernels compute on F32, F16, BF16, Q4_0"):
        ModelShard(str(path), 0, 4, ShardSettings(dtype="float32", compute="lean"))
