"""Float32 weights read as their GGUF Q4_1 codes (`blocks`): the kernel gives the float32 weights' bits exactly, a
float32 shard of the embedded model (a Q4_1 GGUF) reads every layer so, and blocks that would not give a layer's
weights bit for bit are never used."""

import os

import numpy as np
import pytest
import torch

from meshws.model import native
from meshws.model.backend import DecodeStep
from meshws.model.blocks import attach, dequantized, our_blocks
from meshws.model.settings import ShardSettings
from meshws.model.shard import ModelShard

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


Q4_1, Q8_0 = 3, 8  # ggml's type ids


def _gguf_blocks(kind, out, inputs, seed=0):
    """Random bytes of a Q4_1 or Q8_0 tensor as a GGUF holds them: per 32 inputs float16 d (Q4_1: and m), then 16
    bytes of 4-bit codes or 32 of signed 8-bit ones."""
    rng = np.random.default_rng(seed)
    scales = [rng.uniform(1e-4, 0.05, (out, inputs // 32))] + [rng.uniform(-0.4, 0.1, (out, inputs // 32))] * (
        kind == Q4_1)
    head = np.stack(scales, -1).astype(np.float16).view(np.uint8).reshape(out, inputs // 32, -1)
    codes = rng.integers(0, 256, (out, inputs // 32, 16 if kind == Q4_1 else 32), dtype=np.uint8)
    return np.concatenate([head, codes], axis=2).reshape(out, -1)


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_the_blocks_hold_the_values_gguf_dequantises(kind):
    from gguf import GGMLQuantizationType, dequantize

    raw = _gguf_blocks(kind, 40, 96)
    want = dequantize(raw, GGMLQuantizationType(kind))
    got = dequantized(our_blocks(raw, kind, 40, 96))
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


@needs_kernels
@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 24, 70])
def test_a_product_on_the_codes_gives_the_float32_weights_bits(kind, rows):
    # 1030 outputs end past the last whole panel; 8 rows and more take the panel tiles, fewer the dot products
    blocks = our_blocks(_gguf_blocks(kind, 1030, 224, seed=rows), kind, 1030, 224)
    weight = dequantized(blocks).contiguous()
    bias = torch.randn(1030, generator=torch.Generator().manual_seed(4))
    x = torch.randn(rows, 224, generator=torch.Generator().manual_seed(rows))
    want = KERNELS.linear(x, weight, None, bias, 2)
    for threads in (1, 2):
        assert torch.equal(KERNELS.linear(x, blocks, None, bias, threads), want)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(want.double(), exact, rtol=1e-5, atol=1e-4 * float(exact.abs().max()))
    with pytest.raises(ValueError):
        KERNELS.linear(x[:, :192], blocks, None, bias, 1)


def _shard(model, start, end, blocks):
    os.environ["MESHWS_BLOCKS"] = blocks
    try:
        return ModelShard(model, start, end, ShardSettings(dtype="float32"))
    finally:
        os.environ.pop("MESHWS_BLOCKS")


@pytest.fixture(scope="module")
def shards(embedded_model):
    return {flag: _shard(embedded_model, 0, 4, flag) for flag in ("0", "1")}


@needs_kernels
def test_a_float32_shard_of_the_embedded_model_reads_its_layers_as_codes_and_keeps_its_bits(shards):
    plain, coded = shards["0"], shards["1"]
    assert all(packed.blocks is None for layer in plain.lean.layers for packed in layer.linears())
    assert all(packed.blocks is not None for layer in coded.lean.layers for packed in layer.linears())
    assert "float32 weights as GGUF codes" in coded.compute_path and "GGUF codes" not in plain.compute_path
    fp32_bytes = sum(packed.weight.nbytes for layer in coded.lean.layers for packed in layer.linears())
    assert coded.lean.fused.copy_bytes - plain.lean.fused.copy_bytes == fp32_bytes * 24 // 128  # 0.75 B a weight
    prompts = [list(range(100 + i, 110 + 3 * i)) for i in range(16)]  # 10 to 55 tokens: one fused call each
    for shard in (plain, coded):
        shard.outputs = [shard.run_tokens(ids, f"s{i}", "prefill", 0).body for i, ids in enumerate(prompts)]
        for rows in (1, 16):  # a lone step and a batch
            steps = [DecodeStep(f"s{i}", token_id=7 + i) for i in range(rows)]
            shard.outputs += [result.body for result in shard.decode_batch(steps)]
    assert plain.outputs == coded.outputs


@needs_kernels
def test_blocks_that_do_not_give_a_layers_weights_are_not_used(shards):
    coded = shards["1"].lean.layers

    class Source:  # layer i's down projection: the coded shard's blocks, with one code off in layer 1's
        def blocks(self, name):
            if not name.endswith("mlp.down_proj.weight"):
                return None
            layer = int(name.split(".")[2])
            blocks = coded[layer].down.blocks.clone()
            blocks[0, 0, 8] ^= int(layer == 1)
            return blocks

    lean = shards["0"].lean
    try:
        kept = attach(lean, Source(), 0)
        assert [layer.down.blocks is not None for layer in lean.layers] == [True, False, True, True]
        assert kept == 3  # linears given blocks
    finally:
        for layer in lean.layers:
            layer.down = layer.down._replace(blocks=None)


@needs_kernels
def test_a_float32_tail_reads_its_lm_head_as_the_embeddings_codes(embedded_model):
    # SmolLM2's LM head is its embeddings, a Q8_0 tensor in the GGUF; its layers are Q4_1
    plain, coded = (_shard(embedded_model, 27, 30, flag) for flag in ("0", "1"))
    assert plain.lean.lm_head.blocks is None and coded.lean.lm_head.blocks.shape == (49152, 576 // 32, 36)
    assert coded.lean.fused.blocks == 3 * 4 + 1
    hidden = torch.randn(3, 1, 576, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3):
        assert torch.equal(coded.lean.logits(hidden[:rows]), plain.lean.logits(hidden[:rows]))
