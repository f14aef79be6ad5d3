"""meshws's kernel (`native`): built with the machine's compiler, exact to float rounding, and a row's
bits never depend on its batch, on the thread count or on which loop of the kernel ran it."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from meshws.model.kernels import native
from meshws.model.kernels.native import AttendRows
from meshws.model.kv.kv_blocks import KV_BLOCK, LeanCache
from meshws.model.kernels.packed import NATIVE_TOP, linear, pack_linear

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


def _codes(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scales = torch.rand(out_features, generator=generator) * 0.01
    bias = torch.randn(out_features, generator=generator)
    return codes, scales, bias


@needs_kernels
@pytest.mark.parametrize("out_features, in_features", [(96, 576), (7, 13), (5, 19), (4096, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 70, 131])
def test_products_equal_the_dequantized_matrix(out_features, in_features, rows):
    codes, scales, bias = _codes(out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ (codes.double() * scales.double()[:, None]).T + bias.double()
    for with_bias in (True, False):
        got = KERNELS.linear(x, codes, scales, bias if with_bias else None, 2)
        want = exact if with_bias else exact - bias.double()
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 24, 70])
def test_float_weights_multiply_as_they_are_and_a_row_keeps_its_bits_in_any_batch(dtype, rows):
    # 8 rows and more run on panel tiles (rows in vectors), the rows past the last whole group and the outputs past
    # the last whole panel on `tile`; 203 inputs leave a tail past the last whole vector.
    weight = torch.randn(1030, 203, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(1030, generator=torch.Generator().manual_seed(4))
    x = torch.randn(rows, 203, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ weight.double().T + bias.double()
    got = KERNELS.linear(x, weight, None, bias, 2)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4 * float(exact.abs().max()))
    for index in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(KERNELS.linear(x[index : index + 1], weight, None, bias, 1), got[index : index + 1])
    assert torch.equal(KERNELS.linear(x, weight, None, bias, 1), got)
    with pytest.raises(ValueError):  # float weights take no scales, int8 ones must have them
        KERNELS.linear(x, weight, torch.ones(1030), bias, 1)


needs_amx = pytest.mark.skipif(KERNELS is None or not KERNELS.amx, reason="no AMX tiles on this CPU (or kernel)")


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64])
def test_bf16_products_on_amx_tiles_are_right_and_a_row_keeps_its_bits_in_any_batch(rows):
    # 2048 x 1536 is past the work at which the kernel starts threads; 17 and 40 rows take padded blocks, 17, 40
    # and 64 pairs of blocks (40: and a lone one).
    weight = torch.randn(2048, 1536, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bias = torch.randn(2048, generator=torch.Generator().manual_seed(6))
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).float()
    tiles = KERNELS.amx_tiles(weight)
    exact = x.double() @ weight.double().T + bias.double()
    got = KERNELS.amx_linear(x, tiles, bias, 2)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    for index in (0, rows - 1):  # the tiles' rows are independent: alone, in a batch, on any threads
        assert torch.equal(KERNELS.amx_linear(x[index : index + 1], tiles, bias, 1), got[index : index + 1])
    assert torch.equal(KERNELS.amx_linear(x, tiles, bias, 1), got)
    assert KERNELS.amx_tiles(weight[:, :100].contiguous()) is None  # shapes that do not tile: not repacked
    assert KERNELS.amx_tiles(weight[:1000]) is None and KERNELS.amx_tiles(weight.float()) is None
    with pytest.raises(ValueError):
        KERNELS.amx_linear(x[:, :1024], tiles, bias, 1)


@needs_kernels
@pytest.mark.parametrize("in_features", [576, 100])
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_threads(in_features):
    # 4096 x 1536 is past the work at which the kernel starts threads, and 131 rows past the
    # block that widens weights once: every loop of the kernel is in this comparison.
    codes, scales, bias = _codes(4096, in_features, seed=1)
    rows = torch.randn(131, in_features, generator=torch.Generator().manual_seed(2))
    rows[1] *= 1000.0
    batched = KERNELS.linear(rows, codes, scales, bias, 2)
    for threads in (1, 4, 3, 2, 1, 3):  # helpers started by a larger count sit out a smaller one
        assert torch.equal(KERNELS.linear(rows, codes, scales, bias, threads), batched)
    for index in (0, 1, 2, 64, 130):
        alone = KERNELS.linear(rows[index : index + 1], codes, scales, bias, 2)
        assert torch.equal(alone, batched[index : index + 1])
    assert torch.equal(KERNELS.linear(rows[3:5], codes, scales, bias, 1), batched[3:5])


@needs_kernels
def test_a_row_of_nan_or_inf_spoils_only_itself_and_empty_batches_work():
    codes, scales, bias = _codes(96, 192)
    rows = torch.randn(4, 192)
    clean = KERNELS.linear(rows, codes, scales, bias, 1)
    rows[0, 5], rows[2, 0] = float("nan"), float("inf")
    out = KERNELS.linear(rows, codes, scales, bias, 1)
    assert torch.isnan(out[0]).all() and not torch.isfinite(out[2]).any()
    assert torch.equal(out[[1, 3]], clean[[1, 3]])
    assert KERNELS.linear(torch.empty(0, 192), codes, scales, bias, 1).shape == (0, 96)
    with pytest.raises(ValueError, match="float32 rows of width 192"):
        KERNELS.linear(torch.randn(2, 191), codes, scales, bias, 1)
    with pytest.raises(ValueError, match="int8 weights with scales"):
        KERNELS.linear(rows, codes, None, bias, 1)


@needs_kernels
def test_packed_int8_weights_keep_the_whole_range_and_stay_close_to_float():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 576, generator=generator) * 0.05, torch.randn(96, generator=generator)
    weight[3, 7] = 2.0  # one outlier costs only its own channel's precision
    packed = pack_linear(weight, bias, torch.bfloat16, "int8", native=KERNELS)
    assert packed.codes.dtype == torch.int8 and packed.codes.abs().max() == NATIVE_TOP
    assert packed.tensors() == [packed.bias] and packed.int8_bytes == 96 * 576 + 96 * 4
    rows = torch.randn(2, 3, 576, generator=generator)
    exact = torch.nn.functional.linear(rows, weight, bias)
    out = linear(rows.to(torch.bfloat16), packed)
    assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
    error = (linear(rows, packed) - exact).norm() / exact.norm()
    assert error < 0.02, error  # FBGEMM's path (8-bit rows too) is held to 0.03 in test_packed


def test_the_library_is_built_once_per_cache_and_not_without_a_compiler(tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    probe = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
             "from meshws.model.kernels import native; k = native.kernels(); print('LOADED', k is not None)")
    env = {"PATH": "/usr/bin:/bin", "MESHWS_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}

    def run(**extra):
        return subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                              timeout=300, check=True).stdout

    first, second = run(), run()
    assert "built the native kernels" in first and "LOADED True" in first
    assert "built" not in second and "LOADED True" in second  # the cached library
    [library] = (tmp_path / "native").glob("kernels-*.so")
    library.write_bytes(b"not a library")  # cut short, say: built again, once
    third = run()
    assert "built the native kernels" in third and "LOADED True" in third
    library.chmod(0o775)  # writable by the group: someone else could have put it there
    refused = run()
    assert "not ours alone" in refused and "LOADED False" in refused
    library.chmod(0o755)
    assert "LOADED False" in run(CC=str(tmp_path / "no-such-compiler"))
    assert "LOADED False" in run(MESHWS_NATIVE="0")


@needs_kernels
def test_products_from_several_threads_at_once_and_after_a_fork_are_right():
    import os
    import signal
    import threading

    codes, scales, bias = _codes(4096, 576, seed=3)  # past the work at which helper threads join in
    rows = torch.randn(3, 576, generator=torch.Generator().manual_seed(4))
    want = KERNELS.linear(rows, codes, scales, bias, 2)
    wrong = []

    def hammer():  # one caller has the helpers, the others compute alone: the same bits either way
        for _ in range(50):
            if not torch.equal(KERNELS.linear(rows, codes, scales, bias, 2), want):
                wrong.append(1)

    callers = [threading.Thread(target=hammer) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not wrong
    child = os.fork()  # the child has none of the parent's helper threads: it must start its own
    if child == 0:
        signal.alarm(60)  # a hang ends the child, not the test run
        os._exit(0 if torch.equal(KERNELS.linear(rows, codes, scales, bias, 2), want) else 1)
    assert os.waitpid(child, 0)[1] == 0


def _caches(lengths, dtype, kv_heads=3, dim=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    found = []
    for length in lengths:
        cache = LeanCache(2, kv_heads, dim, dtype)
        cache.reserve(length + 1)
        for block in cache.blocks:
            block.data.copy_(torch.randn(block.data.shape, generator=generator).to(dtype))
        cache.length = length
        found.append(cache)
    return found


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 104, 256])  # SmolLM2's heads; a block, lone vectors, a scalar tail; Gemma's
def test_decode_attention_over_caches_of_different_lengths_equals_sdpa_row_by_row(dtype, dim):
    lengths = [0, 4, 39, 300, 1500]  # the last row's scores are too many for the kernel's stack: on the heap
    caches = _caches(lengths, dtype, dim=dim)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(5, 9, 1, dim, generator=generator).to(dtype)
    k, v = (torch.randn(5, 3, 1, dim, generator=generator).to(dtype) for _ in range(2))
    low = [0, 0, 7, 0, 0]  # the third row attends as through a sliding window from position 7
    out = KERNELS.attend(q, k, v, AttendRows(caches, low, lengths, 0.125), 1, 2)
    assert out.shape == q.shape and out.dtype == dtype
    for row, (cache, start, at) in enumerate(zip(caches, low, lengths)):
        written = cache.read(1, at + 1, at)
        assert torch.equal(written[0][0, :, 0], k[row, :, 0]) and torch.equal(written[1][0, :, 0], v[row, :, 0])
        assert not torch.equal(cache.read(0, at + 1, at)[0][0, :, 0], k[row, :, 0]), "only the layer asked is written"
        keys, values = (buffer.float() for buffer in cache.read(1, at + 1, start))
        want = torch.nn.functional.scaled_dot_product_attention(q[row : row + 1].float(), keys, values, scale=0.125,
                                                                 enable_gqa=True)
        assert torch.allclose(out[row : row + 1].float(), want, atol=1e-5 if dtype == torch.float32 else 1e-2)
        alone = KERNELS.attend(q[row : row + 1], k[row : row + 1], v[row : row + 1],
                               AttendRows([cache], [start], [at], 0.125), 1, 1)
        assert torch.equal(alone, out[row : row + 1])


@needs_kernels
def test_decode_attention_refuses_rows_outside_their_caches():
    caches = _caches([5, 5], torch.float32)
    with pytest.raises(ValueError, match="within its cache"):
        AttendRows(caches, [0, 0], [5, caches[1].capacity], 0.125)  # past the buffer: the kernel would write there
    with pytest.raises(ValueError, match="within its cache"):
        AttendRows(caches, [3, 0], [2, 5], 0.125)
    with pytest.raises(ValueError, match="one shape"):
        AttendRows([*caches, *_caches([5], torch.bfloat16)], [0, 0, 0], [5, 5, 5], 0.125)
    rows = AttendRows(caches, [0, 0], [5, 5], 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        KERNELS.attend(torch.randn(2, 9, 1, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), rows, 0, 1)



HARNESS = r"""
#include SOURCE_FILE
#include <float.h>
#include <stdio.h>
static void exp_line(const float *in) { /* one vector of vexp and vround_bf16, against libm and to_bf16 */
    float out[LANES], v[LANES], w[LANES];
    vstore(out, vexp(vload(in)));
    for (int l = 0; l < LANES; l++) w[l] = in[l] * 3.7f;
    vstore(v, vround_bf16(vload(w)));
    for (int l = 0; l < LANES; l++) {
        uint32_t bits, libm_bits; float libm = expf(in[l]), r = to_bf16(w[l]);
        memcpy(&bits, &out[l], 4); memcpy(&libm_bits, &libm, 4);
        printf("exp %08x %08x %d\n", bits, libm_bits, memcmp(&r, &v[l], 4) == 0);
    }
}
int main(void) { /* 16,000 floats across [-110, 110], the edges and NaN; a SiLU row against the scalar formula */
    float in[LANES];
    int n = 0;
    for (int i = 0; i < 16000; i++) {
        in[n++] = -110.0f + 0.01375f * (float)i;
        if (n == LANES) { exp_line(in); n = 0; }
    }
    const float edges[16] = {NAN, -NAN, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, 88.72f, 88.73f,
                             -103.9f, -104.5f, 0.0f, -0.0f, 1e-30f, -87.5f, 89.5f, 1.0f};
    for (int i = 0; i < 16; i += LANES) exp_line(edges + i);
    enum { N = 1004 }; /* 1004 % 16 != 1004 % 8: the padded tails differ between the builds */
    float g[N], u[N], act[N];
    for (int i = 0; i < N; i++) { g[i] = to_bf16((i - 500) * 0.031f); u[i] = to_bf16(1.5f - i * 0.002f); }
    g[N - 1] = NAN; g[N - 2] = INFINITY; g[N - 3] = -INFINITY;
    silu_row(g, u, act, N, 1);
    for (int i = 0; i < N; i++) {
        int round_bf16 = 1;
        float ref = R(R(g[i] / (1.0f + expf(-g[i]))) * u[i]); /* (g and u are bf16 values: R(g) == g) */
        uint32_t bits, ref_bits; memcpy(&bits, &act[i], 4); memcpy(&ref_bits, &ref, 4);
        printf("silu %08x %08x\n", bits, ref_bits);
    }
    float h[N], add[N], x[N], y[N], weight[N]; /* the passes between products, against their scalar loops */
    uint16_t halves[N];
    for (int i = 0; i < N; i++) {
        h[i] = (i - 500) * 0.0371f; add[i] = 0.5f - i * 0.00173f; weight[i] = 1.0f + i * 0.001f;
    }
    h[7] = NAN; h[8] = INFINITY; add[9] = -INFINITY; h[10] = 3.0e38f; add[10] = 3.0e38f;
    for (int round_bf16 = 0; round_bf16 < 2; round_bf16++) {
        memcpy(y, h, sizeof y);
        add_into(y, add, N, round_bf16);
        enum { ROWS = 9, W = N - 11 }; /* a group of rows whose sums run side by side, and one more */
        static float hr[ROWS * W], xr[ROWS * W];
        for (int r = 0; r < ROWS; r++)
            for (int i = 0; i < W; i++) hr[r * W + i] = h[11 + i] * (1.0f + 0.37f * r); /* past the NaN and inf */
        rms_norm(hr, weight, ROWS, W, 1e-5f, xr, round_bf16);
        int same_add = 1, same_norm = 1;
        for (int r = 0; r < ROWS; r++) {
            float squares = 0.0f;
            for (int i = 0; i < W; i++) squares += hr[r * W + i] * hr[r * W + i];
            float inverse = 1.0f / sqrtf(squares / (float)W + 1e-5f);
            for (int i = 0; i < W; i++) {
                float norm = R(weight[i] * R(hr[r * W + i] * inverse));
                same_norm &= memcmp(&norm, &xr[r * W + i], 4) == 0;
            }
        }
        for (int i = 0; i < N; i++) {
            float want = R(h[i] + R(add[i])); /* a product's output, rounded as it is read */
            same_add &= memcmp(&want, &y[i], 4) == 0;
        }
        printf("pass add_into/%d %d\npass rms_norm/%d %d\n", round_bf16, same_add, round_bf16, same_norm);
    }
    memcpy(y, h, sizeof y);
    round_all(y, N);
    bf16_bits(halves, h, N);
    int same_round = 1, same_bits = 1;
    for (int i = 0; i < N; i++) {
        float want = to_bf16(h[i]);
        uint32_t bits; memcpy(&bits, &want, 4);
        same_round &= memcmp(&want, &y[i], 4) == 0;
        same_bits &= halves[i] == (uint16_t)(bits >> 16);
    }
    printf("pass round_all %d\npass bf16_bits %d\n", same_round, same_bits);
    uint16_t uppers[N]; /* to_bf16's outputs (NaN, inf and the largest floats among them): their upper halves */
    upper_halves(uppers, y, N);
    bf16_bits(halves, y, N);
    printf("pass upper_halves %d\n", memcmp(uppers, halves, sizeof uppers) == 0);
    float cos_[N], sin_[N];
    for (int i = 0; i < N; i++) { cos_[i] = 0.9f - i * 0.0013f; sin_[i] = 0.1f + i * 0.0009f; }
    for (int round_bf16 = 0; round_bf16 < 2; round_bf16++) {
        int same_rotate = 1;
        for (int dim = 40; dim <= 64; dim += 24) { /* halves of 20 (a vector and a scalar tail) and 32 */
            float in[64];
            memcpy(in, h + 11, sizeof(float) * dim);
            in[1] = NAN; in[dim / 2 + 2] = NAN; in[dim / 2 + 3] = -INFINITY; /* -b flips a NaN's sign too */
            memcpy(y, in, sizeof(float) * dim);
            rotate(y, cos_, sin_, dim, round_bf16, 0);
            for (int i = 0; i < dim / 2; i++) {
                const float a = in[i], b = in[i + dim / 2];
                const float first = R(R(a * cos_[i]) + R(-b * sin_[i]));
                const float second = R(R(b * cos_[i + dim / 2]) + R(a * sin_[i + dim / 2]));
                same_rotate &= memcmp(&first, &y[i], 4) == 0 && memcmp(&second, &y[i + dim / 2], 4) == 0;
            }
        }
        printf("pass rotate/%d %d\n", round_bf16, same_rotate);
    }
}
"""


def _defines(compiler, flags):
    return subprocess.run([*compiler, "-march=native", *flags, "-dM", "-E", "-"], input="", capture_output=True,
                          text=True, check=True, timeout=60).stdout


def _harness_output(tmp_path, compiler, flags):
    source = tmp_path / "harness.c"
    source.write_text(HARNESS.replace("SOURCE_FILE", f'"{native.SOURCE}"'))
    binary = tmp_path / ("harness" + "".join(flags).replace("-", "_"))
    build = [flag for flag in native.FLAGS if flag not in ("-shared", "-fPIC")]
    subprocess.run([*compiler, *build, *flags, "-o", str(binary), str(source), "-lm"], check=True,
                   capture_output=True, timeout=300)
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()


def _ulps(a, b):
    """Distance in representable floats between two float32 bit patterns (any signs)."""
    def ordered(bits):
        return bits if bits < 0x80000000 else 0x80000000 - bits
    return abs(ordered(a) - ordered(b))


def test_the_vector_exp_and_bf16_rounding_agree_with_libm_and_across_instruction_sets(tmp_path):
    """SiLU's exp runs on vectors (`vexp`): within an ulp of libm's expf, and libm's own result for NaN, inf and
    past the range; the bf16 rounding on vectors gives to_bf16's bits; a SiLU row (its padded tail included) is
    the scalar formula's within an ulp of bf16; the passes between products (residual adds, norms, roundings)
    give their scalar loops' bits exactly. The AVX2 build (machines without AVX-512) gives the AVX-512
    build's bits, so where a model runs does not change its tokens."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        pytest.skip("no C compiler here")
    compiler = found.split()
    defined = _defines(compiler, [])
    if "__AVX2__" not in defined or "__FMA__" not in defined:
        pytest.skip("this CPU runs the plain C kernel (no vector exp)")
    builds = [[]] + ([["-mno-avx512f"]] if "__AVX512F__" in defined else [])
    outputs = [_harness_output(tmp_path, compiler, build) for build in builds]
    assert len({tuple(output) for output in outputs}) == 1  # every instruction set: the same bits
    exps = [line.split()[1:] for line in outputs[0] if line.startswith("exp")]
    assert len(exps) == 16_016
    for got, libm, rounded in exps:
        got, libm = int(got, 16), int(libm, 16)
        is_nan = (libm & 0x7FFFFFFF) > 0x7F800000
        assert ((got & 0x7FFFFFFF) > 0x7F800000) == is_nan, (hex(got), hex(libm))
        if not is_nan:
            assert _ulps(got, libm) <= 1 and (libm not in (0, 0x7F800000) or got == libm), (hex(got), hex(libm))
        assert rounded == "1"
    passes = dict(line.split()[1:] for line in outputs[0] if line.startswith("pass"))
    assert passes == {name: "1" for name in ("add_into/0", "add_into/1", "rms_norm/0", "rms_norm/1", "round_all",
                                            "bf16_bits", "rotate/0", "rotate/1", "upper_halves")}
    silu = [line.split()[1:] for line in outputs[0] if line.startswith("silu")]
    assert len(silu) == 1004
    for got, reference in silu:
        got, reference = int(got, 16), int(reference, 16)
        assert got & 0xFFFF == 0  # a bf16 value
        if (reference & 0x7FFFFFFF) > 0x7F800000:
            assert (got & 0x7FFFFFFF) > 0x7F800000
        else:
            assert _ulps(got, reference) <= 0x10000, (hex(got), hex(reference))  # one bf16 ulp


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_on_shared_blocks_equals_its_own_copy_bit_for_bit(dtype):
    """Two sessions on one prefix's blocks attend as a session holding its own copy, and neither writes the other's."""
    prefix, = _caches([2 * KV_BLOCK + 10], dtype)
    mine, theirs = prefix.copy(2 * KV_BLOCK + 10), prefix.copy(KV_BLOCK + 3)  # the second cuts into a shared block
    alone = LeanCache(2, 3, 64, dtype)
    alone.reserve(prefix.length + 1)
    for block, source in zip(alone.blocks, prefix.blocks):
        block.data.copy_(source.data)
    alone.length = prefix.length
    for cache in (mine, theirs):
        cache.reserve(cache.length + 1)
    assert mine.blocks[:2] == prefix.blocks[:2] and mine.blocks[2] is not prefix.blocks[2]  # copied: written there
    assert theirs.blocks[0] is prefix.blocks[0] and theirs.blocks[1] is not prefix.blocks[1]
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 1, 64, generator=generator).to(dtype)
    k, v = (torch.randn(2, 3, 1, 64, generator=generator).to(dtype) for _ in range(2))
    before = [block.data.clone() for block in prefix.blocks]
    out = KERNELS.attend(q, k, v, AttendRows([mine, theirs], [0, 0], [mine.length, theirs.length], 0.125), 1, 2)
    want = KERNELS.attend(q[:1], k[:1], v[:1], AttendRows([alone], [0], [alone.length], 0.125), 1, 1)
    assert torch.equal(out[:1], want)
    assert all(torch.equal(block.data, old) for block, old in zip(prefix.blocks, before)), "the prefix is unchanged"
    with pytest.raises(ValueError, match="another session holds"):
        AttendRows([prefix.copy(KV_BLOCK)], [0], [5], 0.125)
    for cache in (mine, theirs):
        cache.release()
    assert [block.holders for block in prefix.blocks] == [2, 1, 1]  # (the third block: a copy held the other)


@needs_kernels
def test_q8_0_heads_are_turned_by_the_orthonormal_hadamard_matrix_which_spreads_an_outlier():
    """Keys and values are turned before q8_0 keeps them: the turn is x H (H Sylvester's, orthonormal and its own
    inverse), so q.k is unchanged, and an outlier channel no longer sets its block's scale alone."""
    from meshws.model.kv.kv_blocks import from_q8_0
    from meshws.model.kernels.packed import _hadamard  # (the int8 path's Sylvester matrix, built in torch)

    hadamard = _hadamard(64)
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(5, 3, 64, generator=generator)
    keys[..., 7] *= 40.0  # one channel far larger than the rest, as keys have
    turned = KERNELS.turn(keys)
    assert torch.allclose(turned, keys @ hadamard, atol=1e-4)
    assert torch.allclose(KERNELS.turn(turned), keys, atol=1e-4)
    query = torch.randn(64, generator=generator)
    assert torch.allclose(turned @ KERNELS.turn(query), keys @ query, rtol=1e-4, atol=1e-3)

    def error(values):
        return float((from_q8_0(KERNELS.to_q8_0(values), 64) - values).norm())

    assert error(turned) < error(keys) / 3
    wide = torch.randn(2, 96, generator=generator)  # 96 = 3 x 32: turned by 32-value parts
    assert torch.allclose(KERNELS.turn(wide), (wide.view(2, 3, 32) @ _hadamard(32)).view(2, 96),
                          atol=1e-4)


@needs_kernels
def test_q8_0_rows_are_ggufs_and_attention_reads_them_as_the_widened_floats_bit_for_bit():
    """q8_0 keys and values: quantized as gguf does it, and attention on them equals attention on a float32 cache
    holding their widened values, in a batch as alone (row-invariant bits, as the other kinds)."""
    import gguf

    from meshws.model.kv.kv_blocks import KV_Q8_0, from_q8_0

    generator = torch.Generator().manual_seed(7)
    values = torch.randn(6, 3, 64, generator=generator) * 4
    values[0, 0, :32] = 0.0  # a zero block: scale 0
    blocks = KERNELS.to_q8_0(values)
    want = gguf.quants.quantize(values.numpy().reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    assert blocks.numpy().tobytes() == want.tobytes()
    widened = from_q8_0(blocks, 64)
    dequantized = gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0).reshape(6, 3, 64)
    assert torch.equal(widened, torch.from_numpy(dequantized))

    lengths, low = [3, 70, 200], [0, 0, 9]
    quantized, floats = [], []
    for length in lengths:
        q8, f32 = LeanCache(2, 3, 64, KV_Q8_0), LeanCache(2, 3, 64, torch.float32)
        for cache in (q8, f32):
            cache.reserve(length + 1)
            cache.length = length
        for mine, twin in zip(q8.blocks, f32.blocks):
            mine.data.copy_(KERNELS.to_q8_0(torch.randn(*mine.data.shape[:-1], 64, generator=generator)))
            twin.data.copy_(from_q8_0(mine.data, 64))
        quantized.append(q8)
        floats.append(f32)
    assert quantized[0].nbytes * 64 == floats[0].nbytes * 17  # 34 bytes a 32 values against 128
    q = torch.randn(3, 9, 1, 64, generator=generator)
    k, v = (KERNELS.to_q8_0(torch.randn(3, 3, 1, 64, generator=generator)) for _ in range(2))
    out = KERNELS.attend(q, k, v, AttendRows(quantized, low, lengths, 0.125), 1, 2)
    want = KERNELS.attend(q, from_q8_0(k, 64), from_q8_0(v, 64), AttendRows(floats, low, lengths, 0.125), 1, 2)
    assert torch.equal(out, want)
    for row in range(3):
        assert torch.equal(quantized[row].read(1, lengths[row] + 1)[0], floats[row].read(1, lengths[row] + 1)[0])
        alone = KERNELS.attend(q[row : row + 1], k[row : row + 1], v[row : row + 1],
                               AttendRows([quantized[row]], [low[row]], [lengths[row]], 0.125), 1, 1)
        assert torch.equal(alone, out[row : row + 1])
