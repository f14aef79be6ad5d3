"""The lean path's storage: linear weights packed as tensors (float, or int8 with scales), and KV buffers.

`pack_linear` turns a weight (and bias) into the tuple `linear` runs; with `quant="int8"`
the weight is stored as int8 with one bf16 scale per output channel and runs through
torch's CPU weight-only int8 kernel. `LeanCache` holds one session's keys and values for
a shard's layers in buffers grown in blocks and written in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CACHE_BLOCK = 128  # positions a session's key/value buffers grow by (at least)
INT8_ROWS = 16  # up to this many rows the int8 kernel runs; a longer chunk dequantizes the weight once


# A linear layer as tensors: (weight, bias or None, scale or None). With a scale the weight is int8 [out, in]
# with one bf16 scale per output channel; without, the weight is in the compute dtype (shape [out, in]).
Linear = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None) -> Linear:
    bias = None if bias is None else bias.detach().to(dtype).contiguous()
    if quant != "int8":
        weight = weight.detach().to(dtype)
        if dtype == torch.float32 and weight.shape[0] > weight.shape[1]:  # wide: kept [in, out] (see `linear`)
            return weight.t().contiguous().t(), bias, None
        return weight.contiguous(), bias, None
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.clamp(torch.round(weight / scale[:, None]), -127, 127).to(torch.int8).contiguous()
    return qweight, bias, scale.to(torch.bfloat16).contiguous()


def linear(x: torch.Tensor, packed: Linear) -> torch.Tensor:
    """`x @ weight.T + bias` in x's dtype.

    An int8 weight runs through `aten._weight_int8pack_mm`, which takes bf16 activations
    (fp32 ones run several times slower), so rows are rounded to bf16 on the way in. A
    long prefill chunk dequantizes the weight once instead (the row kernel is slower there).
    """
    weight, bias, scale = packed
    if scale is None:
        # A float weight is [out, in], or a transposed view of [in, out] for outputs wider than inputs: one
        # row through 576 -> 3072 reads 12.2 GB/s that way against 7.8 (2-core AVX2, cold weights), while
        # 1536 -> 576 prefers [out, in] (9.9 against 6.5 GB/s). Batches of 4 and more run alike either way.
        # bf16 keeps [out, in]: its kernels round differently per layout, and bf16 output stays generate()'s.
        return F.linear(x, weight, bias)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] <= INT8_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), weight, scale).to(x.dtype)
    else:
        out = F.linear(rows, weight.to(x.dtype) * scale.to(x.dtype)[:, None])
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


def int8_kernel_runs() -> bool:
    """Does this torch build have the CPU weight-only int8 kernel?"""
    try:
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(x, torch.ones(8, 64, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class LeanCache:
    """One session's keys and values for a shard's layers: buffers `[1, kv_heads, capacity, head_dim]` per layer.

    Written in place at the step's position; grown (copied once) when a step needs more
    room, by at least `CACHE_BLOCK` positions and by half again for long sessions.
    `length` is the positions held; cutting back (`crop_to`) only moves it.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape = (kv_heads, head_dim)
        self.dtype = dtype
        self.keys: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.length = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.empty(1, self.shape[0], capacity, self.shape[1], dtype=self.dtype)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def reserve(self, positions: int) -> None:
        """Room for `positions` positions in every layer (keeps what is held below `length`)."""
        if positions <= self.capacity:
            return
        grown = max(positions, self.capacity + self.capacity // 2)
        grown = -(-grown // CACHE_BLOCK) * CACHE_BLOCK
        keep = min(self.length, self.capacity)
        for buffers in (self.keys, self.values):
            for index, old in enumerate(buffers):
                new = self._empty(grown)
                if keep:
                    new[:, :, :keep].copy_(old[:, :, :keep])
                buffers[index] = new

    def crop_to(self, length: int) -> None:
        self.length = min(self.length, length)

    def copy(self, length: int) -> "LeanCache":
        """Another session's cache holding this one's first `length` positions (room for more reserved)."""
        copied = LeanCache(len(self.keys), *self.shape, self.dtype)
        copied.reserve(length + 1)
        for mine, theirs in ((self.keys, copied.keys), (self.values, copied.values)):
            for old, new in zip(mine, theirs):
                new[:, :, :length].copy_(old[:, :, :length])
        copied.length = length
        return copied
