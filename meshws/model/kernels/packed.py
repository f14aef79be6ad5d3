"""The lean path's linear weights: a GGUF's blocks, float tensors, or int8.

A GGUF's linear is its `BlockTensor`, as the file stores it (`block_linear`), multiplied on meshws's
kernels for any number of rows, with 8-bit activations (`products="q8"`) or exactly widened float32
weights (`"exact"`): a row's result is the same in a decode step as in a prompt. `pack_linear` turns a
float weight (and bias, of a Hugging Face folder's model) into the `Linear` that `linear` runs: float32
weights multiplied by OpenBLAS are kept `[in, out]` with a numpy view (`blas`). With
`quant="int8"` the weight is int8 with one scale per output channel: over the whole
signed range for meshws's own kernel (`native`: activations stay float32), or, where it
cannot be built, prepacked for FBGEMM's int8 GEMM (`quantized::linear_dynamic`), each row
of activations then quantized to int8 on the fly with its own scale. (A session's keys and
values: `kv_blocks`.)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple, Sequence

import numpy
import torch
import torch.nn.functional as F

from ..gguf.block_types import BlockTensor
from .native import Kernels, threads

NATIVE_TOP = 127  # int8 weights for meshws's kernel use the whole signed range
INT8_TOP = 63  # int8 weights in [-63, 63]: with 8-bit activations FBGEMM's AVX2 pair sums stay below 2**15
ROTATION = 64  # the Hadamard block activations and weights are turned by (int8; widths it divides)
FBGEMM_K_BLOCK, FBGEMM_N_BLOCK = 512, 8  # FBGEMM's AVX2 packing pads inputs and outputs to these
_RANGE_ROW = torch.tensor([-1.0, 1.0])  # the start of the first row of every int8 product (see `_int8_linear`)


class Linear(NamedTuple):
    """A linear layer as the lean path holds it.

    A float `weight` is `[out, in]`, or a transposed view of `[in, out]` storage (see `linear`).
    An int8 layer has no float weight: `int8` is FBGEMM's prepacked int8 matrix (see `_int8_linear`).
    """

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    int8: Any = None  # torch's LinearPackedParams (a ScriptObject) or None
    shape: tuple[int, int] = (0, 0)  # (out, in)
    host: Any = None  # a numpy view `[in, out]` of the weight's storage when OpenBLAS multiplies it
    codes: torch.Tensor | None = None  # int8 `[out, in]` for meshws's own kernel (`native`), with...
    scales: torch.Tensor | None = None  # ...one float32 scale per output channel
    kernels: Kernels | None = None  # the library that multiplies `codes` or `blocks`
    blocks: BlockTensor | None = None  # a GGUF's tensor as stored: the weight, read by `kernels`
    products: str = ""  # blocks: "q8" (8-bit activations, integer dots) or "exact" (float32 widening)

    def tensors(self) -> list[torch.Tensor]:
        """The float tensors held (an int8 matrix and its scales are counted apart: see `int8_bytes`; a GGUF's
        blocks are the file's mapped pages: `GgufModel.mapped_bytes`)."""
        return [t for t in (self.weight, self.bias) if t is not None]

    @property
    def int8_bytes(self) -> int:
        """Bytes of the int8 matrix: for meshws's kernel a byte per weight and a float scale per output;
        as FBGEMM packs it, a byte per weight, the inputs padded to its blocks of 512 and the outputs
        to 8 (576 inputs take 1024), and per output channel a double scale, an int64 zero point and
        an int32 column sum."""
        if self.codes is not None and self.scales is not None:
            return self.codes.nbytes + self.scales.nbytes
        if self.int8 is None:
            return 0
        out, inputs = self.shape
        padded = -(-inputs // FBGEMM_K_BLOCK) * FBGEMM_K_BLOCK * -(-out // FBGEMM_N_BLOCK) * FBGEMM_N_BLOCK
        return padded + out * 20


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None,
                openblas: bool = False, native: Kernels | None = None, plain: bool = False) -> Linear:
    """`plain`: a float weight stays `[out, in]`, contiguous, as meshws's kernels read it (`fused`)."""
    bias = None if bias is None else bias.detach().to(dtype).contiguous()
    shape = (weight.shape[0], weight.shape[1])
    if quant == "int8" and native is not None:  # one byte per weight, widened in registers (`native`)
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-30) / NATIVE_TOP
        codes = torch.clamp(torch.round(weight / scale[:, None]), -NATIVE_TOP, NATIVE_TOP).to(torch.int8)
        return Linear(None, None if bias is None else bias.float(), None, shape, None, codes.contiguous(),
                      scale.contiguous(), native)
    if openblas and quant != "int8":  # OpenBLAS reads [in, out] faster for every shape here (`blas`)
        storage = weight.detach().to(torch.float32).t().contiguous()
        return Linear(storage.t(), bias, None, shape, storage.numpy())
    if quant != "int8":
        weight = weight.detach().to(dtype)
        if dtype == torch.float32 and weight.shape[0] > weight.shape[1] and not plain:  # wide: [in, out] (`linear`)
            return Linear(weight.t().contiguous().t(), bias, None, shape)
        return Linear(weight.contiguous(), bias, None, shape)
    weight = _rotated(weight.detach().float())
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_TOP
    qweight = torch.clamp(torch.round(weight / scale[:, None]), -INT8_TOP, INT8_TOP).to(torch.int8)
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (still shipped in 2.13)
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(
            qweight, scale.double(), torch.zeros(shape[0], dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(quantized, None)
    return Linear(None, bias, packed, shape)


def block_linear(blocks: BlockTensor, bias: torch.Tensor | None, native: Kernels, products: str) -> Linear:
    """A GGUF's linear layer: its blocks as stored, multiplied with `products` "q8" or "exact"."""
    return Linear(None, None if bias is None else bias.float().contiguous(), None, blocks.shape, kernels=native,
                  blocks=blocks, products=products)


def parts_linear(x: torch.Tensor, parts: Sequence[Linear]) -> torch.Tensor:
    """`linear` of several matrices read as one (q, k and v; gate and up), outputs side by side."""
    return linear(x, parts[0]) if len(parts) == 1 else torch.cat([linear(x, part) for part in parts], dim=-1)


def linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    """`x @ weight.T + bias` in x's dtype. (Under `--compile`, the kernels' and FBGEMM's products stay outside the
    graphs: `compiled.compile_lean` marks them so, which imports torch's compiler only then, not at every start.)"""
    if packed.blocks is not None:
        return _block_linear(x, packed)
    if packed.host is not None and not torch.compiler.is_compiling():
        return _openblas_linear(x, packed)
    if packed.codes is not None:
        return _native_linear(x, packed)
    if packed.int8 is None:
        # A float weight is [out, in], or a transposed view of [in, out] for outputs wider than inputs: one
        # row through 576 -> 3072 reads 12.2 GB/s that way against 7.8 (2-core AVX2, cold weights), while
        # 1536 -> 576 prefers [out, in] (9.9 against 6.5 GB/s). Batches of 4 and more run alike either way.
        # bf16 keeps [out, in]: its kernels round differently per layout, and bf16 output stays generate()'s.
        return F.linear(x, packed.weight, packed.bias)
    return _int8_linear(x, packed)


def _openblas_linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    rows = x.detach().reshape(-1, x.shape[-1]).float().numpy()
    with numpy.errstate(all="ignore"):  # inf and NaN rows give NaN rows, as torch's product does, without warnings
        out = torch.from_numpy(numpy.matmul(rows, packed.host))
    if packed.bias is not None:
        out += packed.bias
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def _block_linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    assert packed.kernels is not None and packed.blocks is not None
    rows = x.detach().reshape(-1, x.shape[-1]).float()
    out = packed.kernels.qlinear(rows, packed.blocks, packed.bias, threads()) if packed.products == "q8" else \
        packed.kernels.linear(rows, packed.blocks, None, packed.bias, threads())
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def _native_linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    assert packed.kernels is not None and packed.scales is not None and packed.codes is not None
    rows = x.detach().reshape(-1, x.shape[-1]).float()
    out = packed.kernels.linear(rows, packed.codes, packed.scales, packed.bias, threads())
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def _int8_linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    # Two things make FBGEMM's int8 GEMM fit here. It quantizes the activations with one range for
    # the whole matrix, so a row's result would depend on the rows batched with it: each row is
    # scaled to a largest magnitude of 1, and one more row, [-1, +1, 0, ...], goes first (its
    # output is dropped), so the matrix spans exactly [-1, 1] in any batch and the quantization is
    # in effect per row; the outputs are scaled back. (A row holding NaN or inf would move that
    # range, or stop the product: it goes in as zeros and comes out NaN.) And a few channels of a
    # transformer's activations are far larger than the rest, so a row's 8 bits would go to them:
    # the rows (and, once, the weights) are turned by an orthonormal Hadamard block, which spreads
    # those channels over the block and leaves the product unchanged (W x = (W H)(H x), H
    # symmetric). Measured on SmolLM2 with `python -m meshws.tools.quality`: top-1 agreement with
    # fp32 0.83 without the turn, 0.91 with it.
    shape = x.shape
    width = shape[-1]
    rows = _rotated(x.reshape(-1, width).float())
    peak = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)
    spoiled = ~torch.isfinite(peak)
    finite = not bool(spoiled.any())
    if not finite:  # a NaN or inf would reach FBGEMM's range search: such rows go in as zeros, come out NaN
        rows, peak = rows.masked_fill(spoiled, 0.0), peak.masked_fill(spoiled, 1.0)
    scaled = torch.empty(rows.shape[0] + 1, width)
    scaled[0].zero_()
    scaled[0, :2] = _RANGE_ROW
    torch.div(rows, peak, out=scaled[1:])
    out = torch.ops.quantized.linear_dynamic(scaled, packed.int8, False)[1:].mul_(peak)
    if not finite:
        out.masked_fill_(spoiled, float("nan"))
    if packed.bias is not None:
        out = out + packed.bias
    return out.to(x.dtype).view(*shape[:-1], out.shape[-1])


@functools.cache
def _hadamard(size: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of a power-of-two `size` (symmetric: its own inverse)."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix / size ** 0.5).contiguous()


def _rotated(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (float, 2-d) with each block of `ROTATION` columns turned by the Hadamard matrix.

    A width that `ROTATION` does not divide is left as it is (every layer of SmolLM2 and
    Gemma-3 is a multiple of 64): a smaller block measured batch-dependent rounding in MKL's
    product here, and a row must not depend on its batch.
    """
    width = rows.shape[-1]
    if width % ROTATION:
        return rows
    return torch.mm(rows.reshape(-1, ROTATION), _hadamard(ROTATION)).view(rows.shape)


def int8_kernel_runs() -> bool:
    """Does this torch build run FBGEMM's int8 GEMM here (x86 CPUs)? (Other engines round and saturate otherwise.)"""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return False
    try:
        packed = pack_linear(torch.ones(8, 64), None, torch.float32, "int8")
        return bool(torch.allclose(linear(torch.ones(1, 64), packed), torch.full((1, 8), 64.0), rtol=0.05))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
