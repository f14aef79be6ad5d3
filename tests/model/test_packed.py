"""Packed linear layers: int8 rows are quantized each on its own, so batching never changes a row."""

import pytest
import torch

from meshws.model.packed import int8_kernel_runs, linear, pack_linear

pytestmark = pytest.mark.skipif(not int8_kernel_runs(), reason="no FBGEMM int8 GEMM in this torch")


def _layer(out_features=96, in_features=192, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) * 0.01
    return weight, bias


def test_an_int8_row_gives_the_same_bits_alone_and_in_any_batch():
    weight, bias = _layer()
    packed = pack_linear(weight, bias, torch.float32, "int8")
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 192, generator=generator)
    rows[1] *= 1000.0  # a loud neighbour: with one range for the batch it would crush the quiet rows
    rows[2] *= 1e-3
    rows[3, 7] = 80.0  # one outlying channel
    batched = linear(rows, packed)
    for index in range(rows.shape[0]):
        assert torch.equal(linear(rows[index : index + 1], packed), batched[index : index + 1])
    assert torch.equal(linear(rows[2:4], packed), batched[2:4])


@pytest.mark.parametrize("width", [192, 576, 640, 1536, 100])
def test_int8_products_stay_close_to_float(width):
    weight, bias = _layer(in_features=width)
    packed = pack_linear(weight, bias, torch.float32, "int8")
    rows = torch.randn(5, width, generator=torch.Generator().manual_seed(2))
    rows[0, 3] = 40.0  # outliers are what the Hadamard turn is for
    exact = torch.nn.functional.linear(rows, weight, bias)
    error = (linear(rows, packed) - exact).norm() / exact.norm()
    assert error < 0.03, error


def test_int8_keeps_leading_dimensions_and_dtype():
    weight, bias = _layer()
    packed = pack_linear(weight, bias, torch.bfloat16, "int8")
    out = linear(torch.randn(2, 3, 192, dtype=torch.bfloat16), packed)
    assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
    assert packed.int8_bytes >= 96 * 192 and packed.tensors() == [packed.bias]
