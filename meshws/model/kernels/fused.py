"""A Llama-style shard's decode step in one call of meshws's kernel (`mw_decode` in `kernels.c`).

The lean path's layers, run op by op through torch, cost a decode step some forty
framework calls per layer: norms, rotary, residual sums and the products each dispatch
on their own, and at one row the dispatch, not the arithmetic, is most of a layer. Here
the whole step, every layer and every row of a batch, is one call: the products read the
shard's own weights (a GGUF's blocks as stored, with 8-bit activations or widened exactly;
int8 with scales, bfloat16 or float32, `[out, in]`), the elementwise work runs between them
in C, and each row attends to its own cache as `Kernels.attend` does. A bfloat16 model rounds
to bfloat16 wherever torch's bf16 path holds a value in bfloat16, so its tokens stay torch's
up to the order of the sums; float32 stays float32. Qwen2's biases and Qwen3's per-head q/k
norms run here too; a GGUF's Llama rows rotate in pairs (2i, 2i + 1), as llama.cpp stores them.

Gemma-3 (extra norms, soft windows, GELU) keeps the op-by-op path.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from ..kv.kv_blocks import KV_BLOCK
from .native import CACHE_KINDS, KINDS, AttendRows, Kernels, threads


class _Weight(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out", ctypes.c_int64), ("inputs", ctypes.c_int64), ("kind", ctypes.c_int), ("pad", ctypes.c_int),
                ("tiles", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight * 3), ("o", _Weight), ("gate_up", _Weight * 2), ("down", _Weight),
                ("norm_in", ctypes.c_void_p), ("norm_post", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)]


class FusedDecode:
    """The decode step of `lean` (a `LeanLayers` of kind "llama", its linears packed `[out, in]`)."""

    def __init__(self, lean: Any, kernels: Kernels) -> None:
        self.kernels = kernels
        self.layers = len(lean.layers)
        self.heads, self.kv_heads, self.dim = lean.heads, lean.kv_heads, lean.head_dim
        self.eps, self.scale, self.dtype = float(lean.eps), float(lean.scaling), lean.dtype
        self.pairs, self.q8 = int(lean.spec.rope_pairs), int(lean.spec.q8)
        self._keep: list[torch.Tensor] = []  # the float32 copies the structures point into
        self.amx = False  # some products run on AMX tiles (bf16 weights, a CPU that has them)
        self.copy_bytes = 0  # of the copies made for the kernel (AMX tiles, float32 norms of a bf16 model)
        self._array = (_Layer * self.layers)()
        for slot, layer in zip(self._array, lean.layers):
            if len(layer.qkv) not in (1, 3) or len(layer.gate_up) not in (1, 2):
                raise ValueError("q, k and v come as one matrix or three, gate and up as one or two")
            for at, packed in enumerate(layer.qkv):
                slot.qkv[at] = self._weight(packed)
            for at, packed in enumerate(layer.gate_up):
                slot.gate_up[at] = self._weight(packed)
            slot.o, slot.down = self._weight(layer.o), self._weight(layer.down)
            slot.norm_in, slot.norm_post = (self._float(norm) for norm in layer.norms[:2])
            slot.q_norm, slot.k_norm = self._float(layer.q_norm), self._float(layer.k_norm)
        head = lean.lm_head  # a tail's: on AMX tiles as well, where the layers are
        self.head_tiles = self._tiles(head.weight) if self.amx and head is not None and head.weight is not None \
            else None
        self.width = self._array[0].o.out
        q_size, kv_size = self.heads * self.dim, self.kv_heads * self.dim
        inter = self._array[0].down.inputs
        for slot in self._array:  # the C code trusts these for every stride: checked once here
            qkv = [(w.out, w.inputs) for w in slot.qkv if w.out]
            gate_up = [(w.out, w.inputs) for w in slot.gate_up if w.out]
            wanted_qkv = [(q_size + 2 * kv_size, self.width)] if len(qkv) == 1 else \
                [(q_size, self.width), (kv_size, self.width), (kv_size, self.width)]
            wanted_gate_up = [(2 * inter, self.width)] if len(gate_up) == 1 else [(inter, self.width)] * 2
            shapes = [(slot.o.out, slot.o.inputs), (slot.down.out, slot.down.inputs)]
            if qkv != wanted_qkv or gate_up != wanted_gate_up or shapes != [(self.width, q_size), (self.width, inter)] \
                    or self.heads % self.kv_heads or self.dim % 2:
                raise ValueError(f"layer shapes {qkv + gate_up + shapes} do not fit {self.heads} heads, "
                                 f"{self.kv_heads} kv heads")
        for layer in lean.layers:
            if any(norm.numel() != self.width for norm in layer.norms[:2]) or any(
                    t is not None and t.numel() != lin.shape[0] for lin in layer.linears() for t in (lin.bias,
                                                                                                  lin.scales)) \
                    or any(t is not None and t.numel() != self.dim for t in (layer.q_norm, layer.k_norm)):
                raise ValueError("norm weights, biases and scales must have one value per channel")

    def _float(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        copy = tensor.detach().float().contiguous()
        self._keep.append(copy)
        if copy.data_ptr() != tensor.data_ptr():
            self.copy_bytes += copy.numel() * copy.element_size()
        return copy.data_ptr()

    def _weight(self, packed: Any) -> _Weight:
        if packed.blocks is not None:  # a GGUF's tensor as stored: its type id is the kernels' kind
            blocks = packed.blocks
            if packed.kernels is None or (blocks.quantized and blocks.type_id not in packed.kernels.block_types):
                raise ValueError(f"{blocks.name}: the kernels do not compute on {blocks.type_name}")
            return _Weight(blocks.data.data_ptr(), None, self._float(packed.bias), packed.shape[0], packed.shape[1],
                           blocks.type_id, 0, None)
        weight = packed.codes if packed.codes is not None else packed.weight
        if weight is None or weight.dtype not in KINDS or not weight.is_contiguous() \
                or tuple(weight.shape) != tuple(packed.shape):
            raise ValueError("the fused decode takes int8 (with scales), bfloat16 or float32 weights, [out, in]")
        self._keep.append(weight)
        scales = None if packed.codes is None else self._float(packed.scales)
        tiles = self._tiles(weight)  # bf16 products on AMX, where the CPU has it
        self.amx = self.amx or tiles is not None
        return _Weight(weight.data_ptr(), scales, self._float(packed.bias), packed.shape[0], packed.shape[1],
                       KINDS[weight.dtype], 0, None if tiles is None else tiles.data_ptr())

    def _tiles(self, weight: torch.Tensor) -> torch.Tensor | None:
        tiles = self.kernels.amx_tiles(weight)
        if tiles is not None:
            self._keep.append(tiles)
            self.copy_bytes += tiles.numel() * tiles.element_size()
        return tiles

    def logits(self, hidden: torch.Tensor, head: Any, float_rows: int) -> torch.Tensor | None:
        """The LM head `head` (a packed linear) of `hidden` on the kernel: on AMX tiles at any number of rows,
        float weights up to `float_rows` rows; None where the kernel does not take them (torch's then)."""
        weight = head.weight  # (a GGUF's blocks: `packed.linear`)
        if self.head_tiles is None and (weight is None or hidden.numel() > float_rows * hidden.shape[-1]):
            return None
        rows = hidden.detach().reshape(-1, hidden.shape[-1]).float()
        bias = None if head.bias is None else head.bias.float()
        out = self.kernels.amx_linear(rows, self.head_tiles, bias, threads()) if self.head_tiles is not None \
            else self.kernels.linear(rows, weight, None, bias, threads())
        return out.to(hidden.dtype).view(*hidden.shape[:-1], out.shape[-1])

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[Any],
            pasts: Sequence[int], threads: int) -> torch.Tensor:
        """Rows `[rows, 1, width]`, row r at position `pasts[r]` of `caches[r]` (room reserved), through every
        layer; `cos`, `sin` `[rows, head_dim]` for those positions. The caches' keys and values are written
        at `pasts`; their lengths are the caller's to move."""
        rows = len(caches)
        if hidden.shape != (rows, 1, self.width) or not cos.shape == sin.shape == (rows, self.dim) \
                or any(cache.layers != self.layers for cache in caches):
            raise ValueError(f"a decode step of {rows} rows does not fit the fused layers")
        checked = AttendRows(caches, [0] * rows, pasts, self.scale)  # dtype, shape, room and distinct caches
        if (checked.kv_heads, checked.dim) != (self.kv_heads, self.dim):
            raise ValueError(f"caches of {checked.kv_heads} heads of {checked.dim} do not fit these layers")
        state = hidden.detach().reshape(rows, self.width).to(torch.float32, copy=True).contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        failed = self.kernels.decode(rows, self.layers, ctypes.addressof(self._array), self.width, self.heads,
                                     self.kv_heads, self.dim, self.eps, self.scale, int(self.dtype == torch.bfloat16),
                                     state.data_ptr(), cos.data_ptr(), sin.data_ptr(), checked.blocks.ctypes.data,
                                     checked.first.ctypes.data, KV_BLOCK, checked.low_at.ctypes.data,
                                     checked.low_at.ctypes.data + 8 * rows, CACHE_KINDS[checked.dtype], self.pairs,
                                     self.q8, threads)
        if failed:
            raise MemoryError("no memory for a decode step")
        return state.to(hidden.dtype).view(rows, 1, self.width)
