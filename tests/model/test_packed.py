"""Packed int8 linear layers: each row is quantized on its own (batching never changes a row), the
Hadamard turn keeps outlier channels from costing precision, and FBGEMM's sums never saturate."""

import pytest
import torch

from meshws.model.kernels.packed import _rotated, int8_kernel_runs, linear, pack_linear

pytestmark = pytest.mark.skipif(not int8_kernel_runs(), reason="no FBGEMM int8 GEMM in this torch")


def _layer(out_features=96, in_features=192, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) * 0.01
    return weight, bias


@pytest.mark.parametrize("width", [192, 576, 1536, 100])
def test_an_int8_row_gives_the_same_bits_alone_and_in_any_batch(width):
    weight, bias = _layer(in_features=width)
    packed = pack_linear(weight, bias, torch.float32, "int8")
    rows = torch.randn(6, width, generator=torch.Generator().manual_seed(1))
    rows[1] *= 1000.0  # a loud neighbour: with one range for the batch it would crush the quiet rows
    rows[2] *= 1e-3
    rows[3, 7] = 80.0  # one outlying channel
    batched = linear(rows, packed)
    for index in range(rows.shape[0]):
        assert torch.equal(linear(rows[index : index + 1], packed), batched[index : index + 1])
    assert torch.equal(linear(rows[2:4], packed), batched[2:4])


def test_a_row_of_nan_or_inf_spoils_only_itself():
    weight, bias = _layer()
    packed = pack_linear(weight, bias, torch.float32, "int8")
    rows = torch.randn(4, 192, generator=torch.Generator().manual_seed(3))
    clean = linear(rows, packed)
    rows[0, 5] = float("nan")  # the first row: FBGEMM's range search starts there
    rows[2, 0] = float("inf")
    out = linear(rows, packed)
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    assert torch.equal(out[[1, 3]], clean[[1, 3]])


@pytest.mark.parametrize("width", [192, 576, 640, 1536, 100])
def test_int8_products_stay_close_to_float(width):
    weight, bias = _layer(in_features=width)
    packed = pack_linear(weight, bias, torch.float32, "int8")
    rows = torch.randn(5, width, generator=torch.Generator().manual_seed(2))
    rows[0, 3] = 40.0  # outliers are what the Hadamard turn is for
    exact = torch.nn.functional.linear(rows, weight, bias)
    error = (linear(rows, packed) - exact).norm() / exact.norm()
    assert error < 0.03, error


@pytest.mark.parametrize("width", [192, 100])
def test_the_largest_weights_and_activations_do_not_saturate(width):
    # Turned, these are all ones: every weight quantizes to the top value and every activation to
    # 255, the case where AVX2's pairwise 16-bit sums would clip with full-range int8 weights.
    ones = _rotated(torch.ones(1, width))
    weight = ones.repeat(8, 1)
    exact = torch.nn.functional.linear(ones, weight)
    out = linear(ones, pack_linear(weight, None, torch.float32, "int8"))
    assert torch.allclose(out, exact, rtol=0.02), (out[0, :3], exact[0, :3])


def test_int8_keeps_leading_dimensions_dtype_and_counts_fbgemm_padding():
    weight, bias = _layer(in_features=576)
    packed = pack_linear(weight, bias, torch.bfloat16, "int8")
    out = linear(torch.randn(2, 3, 576, dtype=torch.bfloat16), packed)
    assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
    assert packed.tensors() == [packed.bias]
    assert packed.int8_bytes == 1024 * 96 + 96 * 20  # 576 inputs are packed as two blocks of 512
