"""GGUF's block types on meshws's kernels (`quants.c`): one table, exact widening, products on the blocks as stored.

Widening is `gguf.quants.dequantize`'s, bit for bit, type by type, on random blocks whose scales include
+-0, subnormals, the largest float16 values, infinities and NaNs. A float32 product on the blocks is the
product of the widened weights, bit for bit; the 8-bit products (the default) stay within quantization's
error of the float64 product. Either way a row's result does not depend on the rows batched with it, on
the thread count, or on the instruction set the library was built for.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from meshws.model.kernels import native
from meshws.model.gguf.block_types import BlockTensor

KERNELS = native.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: meshws's kernels cannot be built")

TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
         14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS"}
# Where each type keeps its float16 scales (d; and m or dmin) within a block.
SCALES = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208],
          20: [0], 23: [0]}
SPECIAL = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, np.inf, -np.inf, np.nan], dtype=np.float16)


def _blocks(type_id, rows, columns, seed=0, special=False):
    """Random bytes of a `type_id` tensor, its scales sane (or, with `special`, drawn from the edge values)."""
    elements, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * columns // elements, size), dtype=np.uint8)
    for at in SCALES[type_id]:
        values = rng.choice(SPECIAL, len(raw)) if special else rng.uniform(1e-4, 1e-2, len(raw)) * (
            -1 if at == 2 and type_id in (3, 7) else 1)
        raw[:, at:at + 2] = np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _tensor(type_id, raw, columns):
    return BlockTensor("test", type_id, (raw.shape[0], columns), torch.from_numpy(np.ascontiguousarray(raw)))


def test_the_kernels_table_is_ggufs():
    """The library's table (`quants.c`), asked id by id, has these types and no other, each with gguf's sizes
    (`kernel_types` refuses a library that disagrees)."""
    assert KERNELS.block_types == TYPES


@pytest.mark.parametrize("type_id", TYPES, ids=TYPES.values())
@pytest.mark.parametrize("special", [False, True], ids=["random", "edge-scales"])
def test_widening_is_gguf_dequantize_bit_for_bit(type_id, special):
    # rows longer than the 2048 values bfloat16 widening takes at a time, and a last piece shorter than 256 values
    columns = 2304 if GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0] == 256 else 2144
    raw = _blocks(type_id, 24, columns, seed=type_id, special=special)
    with np.errstate(all="ignore"):
        want = dequantize(raw, GGMLQuantizationType(type_id)).reshape(24, columns)
    got = KERNELS.widen(_tensor(type_id, raw, columns)).numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))  # +-0 and subnormals included
    ids = torch.tensor([23, 0, 7, 7])  # rows widened on lookup, as embeddings are
    assert torch.equal(KERNELS.widen(_tensor(type_id, raw, columns), ids).view(torch.int32),
                       torch.from_numpy(got)[ids].view(torch.int32))
    bf16 = KERNELS.widen(_tensor(type_id, raw, columns), dtype=torch.bfloat16)
    assert torch.equal(bf16[~torch.from_numpy(nan)], torch.from_numpy(want).to(torch.bfloat16)[~torch.from_numpy(nan)])


@pytest.mark.parametrize("type_id", TYPES, ids=TYPES.values())
def test_a_float32_product_on_the_blocks_is_the_widened_weights_product(type_id):
    columns = 768 if GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0] == 32 else 512  # (not a multiple of 256)
    blocks = _tensor(type_id, _blocks(type_id, 40, columns, seed=type_id), columns)
    weights = KERNELS.widen(blocks)
    rows = torch.randn(9, columns)
    on_blocks = KERNELS.linear(rows, blocks, None, None, 2)
    assert torch.equal(on_blocks, KERNELS.linear(rows, weights, None, None, 2))
    for count in (1, 2, 5):  # a row's bits in any batch, on any thread count
        assert torch.equal(KERNELS.linear(rows[:count], blocks, None, None, 1), on_blocks[:count])
    want = rows.double() @ weights.double().T
    assert (on_blocks.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("type_id", TYPES, ids=TYPES.values())
def test_8_bit_products_are_close_and_a_row_keeps_its_bits_in_any_batch(type_id):
    columns = 768 if GGML_QUANT_SIZES[GGMLQuantizationType(type_id)][0] == 32 else 1024
    blocks = _tensor(type_id, _blocks(type_id, 70, columns, seed=type_id), columns)
    exact = KERNELS.widen(blocks).double()
    rows = torch.randn(19, columns)
    bias = torch.randn(70)
    got = KERNELS.qlinear(rows, blocks, bias, 2)
    want = rows.double() @ exact.T + bias.double()
    assert ((got.double() - want).norm() / want.norm()) < 0.02  # 8 bits a value: about half a percent
    for count in (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 14, 16, 18):  # (AVX2: groups of up to 16 rows, the last 1-3 alone)
        assert torch.equal(KERNELS.qlinear(rows[:count], blocks, bias, 1), got[:count])
    assert torch.equal(KERNELS.qlinear(rows[-1:], blocks, bias, 2), got[-1:])
    spoiled = rows.clone()
    spoiled[4, 3] = float("nan")
    out = KERNELS.qlinear(spoiled, blocks, bias, 2)
    assert torch.isnan(out[4]).all() and torch.equal(out[:4], got[:4]) and torch.equal(out[5:], got[5:])
    huge = rows[:6].clone()  # finite, but d times a block's code sum (32 x 127) overflows: the same in any batch
    huge[1] = 2e37
    alone, batched = KERNELS.qlinear(huge[:2], blocks, bias, 1), KERNELS.qlinear(huge, blocks, bias, 1)
    assert not torch.isfinite(alone[1]).all() and torch.equal(alone.isnan(), batched[:2].isnan())
    assert torch.equal(alone.nan_to_num(), batched[:2].nan_to_num())


def test_health_says_how_a_batch_multiplies_each_block_type():
    paths = KERNELS.product_paths([8, 3, 12, 3])
    assert list(paths) == ["Q4_1", "Q8_0", "Q4_K"]
    assert paths["Q4_K"] == "each weight row against 8 rows at a time"
    for name, type_id in (("Q4_1", 3), ("Q8_0", 8)):  # (the rows on each side of the switch keep their bits: above)
        rows = KERNELS.direct_rows[type_id]
        assert paths[name].startswith(f"1-{rows} rows: straight from the blocks") if rows else \
            paths[name] == "tiles of 16 outputs, laid out once for all the rows"


def test_what_the_kernels_are_handed_is_checked():
    raw = _blocks(12, 4, 256)
    blocks = _tensor(12, raw, 256)
    with pytest.raises(ValueError, match="width 256"):
        KERNELS.qlinear(torch.randn(1, 128), blocks, None, 1)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        KERNELS.widen(blocks, torch.tensor([4]))
    iq2_xxs = BlockTensor("blk.0.ffn_up.weight", 16, (4, 256), torch.zeros(4, 66, dtype=torch.uint8))
    with pytest.raises(ValueError, match="IQ2_XXS; the kernels compute on F32, F16, BF16, Q4_0"):
        KERNELS.linear(torch.randn(1, 256), iq2_xxs, None, None, 1)


NO_MEMORY = r"""
import resource, sys, torch
from meshws.model.kernels import native
from meshws.model.gguf.block_types import BlockTensor
kernels, columns = native.kernels(), 1 << 26  # a float32 product widens 4 outputs at a time: 1 GiB for this width
blocks = BlockTensor("w", 2, (4, columns), torch.zeros(4, columns // 32 * 18, dtype=torch.uint8))  # Q4_0
rows = torch.ones(1, columns)
status = open("/proc/self/status").read()
mapped = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    kernels.linear(rows, blocks, None, None, 1)
except MemoryError as exc:
    print("MemoryError:", exc)
"""


def test_a_float32_product_with_no_memory_to_widen_into_raises_memory_error():
    """With no memory for a tile of widened weights, a product on block weights read the blocks as float32 values
    past their end; now the product fails (MemoryError: a shard undoes the step), in a process whose address space is
    capped (run apart: a crash must not take pytest with it)."""
    done = subprocess.run([sys.executable, "-c", NO_MEMORY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "MemoryError: no memory to widen a product's weights into"


HARNESS = r"""
#include SOURCE_FILE
#include <stdio.h>
/* Every type's 8-bit products of 17 fixed random rows (AVX2: groups of 13 and 4 rows) and of 3 (straight from the
   blocks), printed as bits: the same on every instruction set. */
int main(void) {
    static uint8_t w[70 * 1024 * 2];
    static float x[17 * 1088], y[17 * 70];
    unsigned seed = 12345;
    for (size_t i = 0; i < sizeof w; i++) { seed = seed * 1103515245u + 12345u; w[i] = (uint8_t)(seed >> 16); }
    for (int i = 0; i < 17 * 1088; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
    const int types[] = {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23};
    const int scales[][2] = {{0, 2}, {0, 2}, {0, 2}, {0, 2}, {0, 2}, {80, 82}, {108, 108}, {0, 2}, {0, 2}, {208, 208},
                             {0, 0}, {0, 0}}; /* where each keeps its float16 d (and m, dmin) */
    for (int t = 0; t < 12; t++) {
        const block_type *bt = block_type_of(types[t]);
        for (size_t b = 0; b < sizeof w / bt->bytes; b++) { /* sane scales: 2^-10 */
            uint8_t *block = w + b * bt->bytes;
            const uint16_t h = 0x1400;
            memcpy(block + scales[t][0], &h, 2);
            memcpy(block + scales[t][1], &h, 2);
        }
        for (int in = 1024; in <= 1088; in += 64) { /* (1088: a last unit of two blocks, for the 32-value types) */
            if (in % bt->elements)
                continue;
            for (int rows = 17; rows > 0; rows -= 14) {
                mw_qlinear(x, rows, in, w, types[t], NULL, y, 70, 70, 1);
                for (int i = 0; i < rows * 70; i++) {
                    uint32_t bits;
                    memcpy(&bits, y + i, 4);
                    printf("%d %08x\n", types[t], bits);
                }
            }
        }
    }
}
"""


def test_8_bit_products_give_the_same_bits_on_every_instruction_set(tmp_path):
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        pytest.skip("no C compiler here")
    source = tmp_path / "harness.c"
    source.write_text(HARNESS.replace("SOURCE_FILE", f'"{native.SOURCE}"'))
    build = [flag for flag in native.FLAGS if flag not in ("-shared", "-fPIC")]
    outputs = []
    for extra in ([], ["-mno-avx512f"], ["-march=x86-64"], ["-DGENERIC_ROWS"], ["-mno-avx512f", "-DGENERIC_ROWS"]):
        # this CPU's; AVX2; no vectors at all; then every row as a type added with its `unpack` alone: the generic
        # path's vectors (this CPU's, AVX2) where a type has no loop of its own
        binary = tmp_path / ("harness" + "".join(extra).replace("-", "_").replace("=", "_"))
        subprocess.run([found, *build, *extra, "-o", str(binary), str(source), "-lm"], check=True,
                       capture_output=True, timeout=300)
        outputs.append(subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                                      timeout=120).stdout)
    assert len(outputs[0].splitlines()) == (12 + 6) * (17 + 3) * 70  # (six types of 32 values also with 1088 inputs)
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[3] == outputs[4]
    # the generic path gives each type's own loops' bits, but Q4_K's: its loops take its nibbles in their own order
    own = [line for line in outputs[0].splitlines() if not line.startswith("12 ")]
    assert [line for line in outputs[3].splitlines() if not line.startswith("12 ")] == own
    assert outputs[3] != outputs[0]  # (Q4_K's lines: the build did run the generic path)
