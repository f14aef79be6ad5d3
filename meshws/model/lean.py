"""The lean path: a shard's decoder layers run on its own weights, without transformers' modules.

A shard's layers come as `LayerWeights` (`lean_weights` builds them from a GGUF's blocks as stored, or
packs a Hugging Face model's float weights), and `LeanSpec` says how they compute: Llama-style layers
(Llama, Qwen2's q/k/v biases, Qwen3's per-head q/k norms; rotary on halves, or on pairs (2i, 2i+1) for
a GGUF's Llama rows) or Gemma-3's (extra norms, GELU, sliding windows). A session's keys and values
live in a `kv_blocks.LeanCache`: blocks of positions, shared between sessions where their prompts agree. A Llama-style
decode step, for one session or a batch of them, is one call of meshws's kernel through every layer
(`fused.FusedDecode`). Otherwise a decode step's attention is one kernel call per layer over every row's
own cache (`native.Kernels.attend`; torch's sdpa row by row where the kernel cannot be built); prefill
attention is torch's `scaled_dot_product_attention`. The rest follows transformers' modules operation
by operation, so float32 tokens are the transformers path's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .gguf.block_types import BlockTensor
from .kv.cache_store import KVCacheMiss
from .kernels.fused import FusedDecode
from .kernels.native import AttendRows, Kernels
from .kernels.native import threads as kernel_threads
from .kv.kv_blocks import KV_Q8_0, LeanCache, row_width
from .kernels.packed import Linear, linear, parts_linear
from .tensors import causal_mask, rotate_half

# Rows a fused step takes (sessions, or a lap of drafts); the LM head a quarter. torch's AVX512-BF16 products beat
# the kernel's beyond: 16 rows x the LM head 3.9 ms on torch, 6.8 on the kernel (fp32: 14.5 against 8.0). A GGUF's
# blocks run on the kernels for any number of rows (a prompt's chunk too: `ANY_ROWS`), so that a row's result is
# the same in a prompt as in a decode step or a batch (a replayed answer is the one given).
FUSED_ROWS = {torch.bfloat16: 8, torch.float32: 64}
ANY_ROWS = 1 << 30

RopeTable = Callable[[str, int], tuple[torch.Tensor, torch.Tensor]]  # (layer type, positions) -> cos, sin [n, dim]


@dataclass
class LayerWeights:
    """One decoder layer's weights as the lean path reads them."""

    qkv: tuple[Linear, ...]  # q, k and v: three matrices (a GGUF's), or one
    o: Linear
    gate_up: tuple[Linear, ...]  # gate and up: two, or one
    down: Linear
    norms: tuple[torch.Tensor, ...]  # input, post-attention (Gemma: then pre- and post-feedforward); Gemma's as 1 + w
    q_norm: torch.Tensor | None = None  # per-head norms of q and k (Qwen3, Gemma-3)
    k_norm: torch.Tensor | None = None

    def linears(self) -> tuple[Linear, ...]:
        return (*self.qkv, self.o, *self.gate_up, self.down)


@dataclass(frozen=True)
class LeanSpec:
    """How a shard's lean layers compute."""

    kind: str  # "llama" (Llama, Qwen2, Qwen3: the fused decode) or "gemma3"
    dtype: torch.dtype  # hidden states in torch's operations
    cache_dtype: torch.dtype | str  # keys and values: float32, bfloat16 or "q8_0" (`kv_blocks.KV_Q8_0`)
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    layer_types: tuple[str, ...]  # this shard's layers
    window: int | None  # sliding attention's
    rope: RopeTable
    rope_pairs: bool = False  # rotate (2i, 2i + 1) rather than (i, i + dim / 2)
    weights: str = ""  # what the weights are, for `describe`: "GGUF blocks (Q4_K, Q6_K), 8-bit activations"
    q8: bool = False  # block products quantize the activations to 8 bits


class LeanLayers:
    """A shard's decoder layers (and its final norm) on its own weights; also the batched-rows runner."""

    fits = True  # batched decode runs through `run_rows`
    compiled = False

    def __init__(self, spec: LeanSpec, layers: list[LayerWeights], final_norm: torch.Tensor | None,
                 lm_head: Linear | None, native: Kernels | None, fused: bool = True, quant: str | None = None,
                 openblas: bool = False) -> None:
        self.spec, self.layers, self.lm_head = spec, layers, lm_head
        self.kind, self.dtype, self.quant, self.openblas = spec.kind, spec.dtype, quant, openblas
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.eps, self.scaling, self.window = spec.eps, spec.scaling, spec.window
        self.layer_types = list(spec.layer_types)
        self.final_norm_weight = final_norm  # the tail's (Gemma's as 1 + w); None elsewhere
        self.kernels = native  # decode attention on meshws's kernel (else torch's sdpa, row by row)
        self.native = native if quant == "int8" else None  # int8 products on meshws's kernel, else FBGEMM's
        self.attention = "meshws kernel" if native else "torch sdpa"
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._before = self._before_attention  # or their compiled versions (`compiled.compile_lean`)
        self._after = self._after_attention
        fused = fused and native is not None and spec.kind == "llama" and len(layers) > 0
        self.fused = FusedDecode(self, native) if fused and native is not None else None
        # On AMX tiles a batch of bf16 rows costs the kernel little more than one row: every batch runs fused; a
        # GGUF's blocks always run on the kernels.
        blocks = any(lin.blocks is not None for layer in layers for lin in layer.linears())
        self.on_blocks = blocks  # a GGUF's blocks, on the kernels for any rows (prompts may share a call)
        self.fused_rows = ANY_ROWS if blocks else 64 if quant or (self.fused and self.fused.amx) else \
            FUSED_ROWS.get(spec.dtype, 0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (a tail only); on meshws's kernel where decode is, if it takes these rows."""
        assert self.lm_head is not None
        out = None if self.fused is None else self.fused.logits(hidden, self.lm_head, self.fused_rows // 4)
        return linear(hidden, self.lm_head) if out is None else out

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.final_norm_weight is None else self._norm(hidden, self.final_norm_weight)

    def describe(self) -> str:
        kernel = " (meshws kernel)" if self.native else " (FBGEMM)"
        return (f"lean {self.kind}" + (f", {self.spec.weights}" if self.spec.weights else "")
                + (f", {self.quant} weights{kernel}" if self.quant else "")
                + (", decode fused (meshws kernel)" if self.fused else "")
                + (", bf16 products on AMX tiles" if self.fused and self.fused.amx else "")
                + (", OpenBLAS products" if self.openblas else "") + (", compiled" if self.compiled else ""))

    def block_weights(self) -> list[BlockTensor]:
        """The GGUF block tensors multiplied with 8-bit activations here (the layers', then the LM head's)."""
        return [lin.blocks for lin in self._linears() if lin.blocks is not None and lin.products == "q8"]

    def facts(self) -> dict[str, Any]:
        """/health: how a batch's 8-bit block products run, per block type (none on other weights), and what this
        node measured to choose between two paths (`paths.choose_paths`)."""
        types = [weight.type_id for weight in self.block_weights()]
        if not types or not self.kernels:
            return {"products": {}}
        names = {self.kernels.block_types.get(type_id) for type_id in types}
        return {"products": self.kernels.product_paths(types),
                "paths": {name: facts for name, facts in self.kernels.measured_paths.items() if name in names}}

    def _linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head] * (self.lm_head is not None)

    def tensors(self) -> list[torch.Tensor]:
        """The float tensors held (int8 matrices: `int8_bytes`; a GGUF's blocks: its mapped bytes)."""
        norms = [t for layer in self.layers for t in (*layer.norms, layer.q_norm, layer.k_norm) if t is not None]
        return [t for lin in self._linears() for t in lin.tensors()] + norms + [self.final_norm_weight] * (
            self.final_norm_weight is not None)

    kept_bytes = property(lambda self: self.int8_bytes + (self.fused.copy_bytes if self.fused else 0),
                          doc="Bytes held outside `tensors()`: int8 matrices, the kernel's copies (AMX tiles).")

    @property
    def int8_bytes(self) -> int:
        return sum(lin.int8_bytes for lin in self._linears())

    @property
    def int8_parameters(self) -> int:
        quantized = [lin for lin in self._linears() if lin.int8 is not None or lin.codes is not None]
        return sum(lin.shape[0] * lin.shape[1] for lin in quantized)

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.spec.cache_dtype)

    # -- rotary tables ---------------------------------------------------------

    def _table(self, layer_type: str, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[positions, head_dim]` for positions 0..needed-1 at least (computed once, grown by doubling)."""
        table = self._tables.get(layer_type)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * table[0].shape[0] if table is not None else 1024)
            table = self.spec.rope(layer_type, size)
            self._tables[layer_type] = table
        return table

    def rope(self, positions: torch.Tensor, needed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, cos and sin for `positions` (flat), shaped to broadcast over `[rows, heads, T, dim]`."""
        found = {}
        for layer_type in set(self.layer_types):
            cos, sin = self._table(layer_type, needed)
            found[layer_type] = (cos[positions].to(self.dtype), sin[positions].to(self.dtype))
        return found

    # -- the arithmetic, as transformers does it -------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "gemma3":
            return (normed * weight).type_as(x)
        return weight * normed.to(x.dtype)

    def _mlp(self, x: torch.Tensor, gate_up: tuple[Linear, ...], down: Linear) -> torch.Tensor:
        gate, up = parts_linear(x, gate_up).chunk(2, dim=-1)
        if self.kind == "gemma3":
            return linear(F.gelu(gate, approximate="tanh") * up, down)
        return linear(F.silu(gate) * up, down)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.spec.rope_pairs:
            return x * cos + rotate_half(x) * sin
        half = x.shape[-1] // 2  # pair i (2i, 2i + 1) by angle i: the same operations as `rotate_half`'s
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos + turned * sin

    def _before_attention(self, hidden: torch.Tensor, layer: LayerWeights, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, projections and rotary: q `[rows, heads, T, dim]`, k and v `[rows, kv_heads, T, dim]`."""
        rows, count = hidden.shape[0], hidden.shape[1]
        x = self._norm(hidden, layer.norms[0])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = parts_linear(x, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(rows, count, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(rows, count, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(rows, count, self.kv_heads, self.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            q = self._norm(q, layer.q_norm)
        if layer.k_norm is not None:
            k = self._norm(k, layer.k_norm)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _after_attention(self, hidden: torch.Tensor, attended: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """Output projection, residuals, norms and MLP."""
        rows, count = hidden.shape[0], hidden.shape[1]
        out = linear(attended.transpose(1, 2).reshape(rows, count, self.heads * self.head_dim), layer.o)
        norms = layer.norms
        if self.kind == "gemma3":
            hidden = hidden + self._norm(out, norms[1])
            x = self._norm(hidden, norms[2])
            return hidden + self._norm(self._mlp(x, layer.gate_up, layer.down), norms[3])
        hidden = hidden + out
        return hidden + self._mlp(self._norm(hidden, norms[1]), layer.gate_up, layer.down)

    def _block(self, layer: LayerWeights, hidden: torch.Tensor, attend: Callable[[torch.Tensor, torch.Tensor,
               torch.Tensor], torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self._before(hidden, layer, cos, sin)
        if self.spec.cache_dtype == KV_Q8_0:  # kept turned (`Kernels.turn`): q.k as before, the output turned back
            turn = self.kernels.turn
            return self._after(hidden, turn(attend(turn(q), turn(k), turn(v))).to(q.dtype), layer)
        return self._after(hidden, attend(q, k, v), layer)

    def _cached(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keys or values as the cache stores them."""
        if self.spec.cache_dtype == KV_Q8_0:
            return self.kernels.to_q8_0(tensor)
        return tensor.to(self.spec.cache_dtype)

    def use_kv_dtype(self, kv_dtype: str) -> None:
        """Keys and values in `kv_dtype` (--kv-dtype): auto keeps the default (bfloat16 under 8-bit activations,
        float32 under exact products); q8_0 needs meshws's kernels. ValueError where it cannot be."""
        if kv_dtype == "auto":
            return
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "q8_0": KV_Q8_0}[kv_dtype]
        if dtype == KV_Q8_0 and self.kernels is None:
            raise ValueError("--kv-dtype q8_0 needs meshws's kernels, which could not be built here")
        row_width(dtype, self.head_dim)  # (q8_0: heads of a multiple of 32 values)
        self.spec = replace(self.spec, cache_dtype=dtype)

    # -- one session: a prefill, a chunk or a decode step ----------------------

    def run(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: LeanCache | None) -> torch.Tensor:
        """Hidden states `[1, T, hidden]` at `position_ids` (consecutive) through the layers and the final norm.
        With a cache the step's keys and values are written at its positions and attention sees everything
        before them; without one the step runs stateless from position 0."""
        count = hidden.shape[1]
        past = int(position_ids[0, 0]) if count else 0
        total = past + count
        if cache is None and past:
            raise ValueError("a stateless step starts at position 0")
        if cache is not None and count == 1:  # a decode step: a batch of one row
            return self._run_rows(hidden, position_ids, [cache])
        if cache is not None:
            _room(cache, past, total)
        rope = self.rope(position_ids[0], total)
        if cache is not None and self.fused is not None and count <= self.fused_rows:  # rows of one session
            hidden = self.fused.run(hidden.view(count, 1, -1), *rope[self.layer_types[0]], [cache] * count,
                                    range(past, total), kernel_threads()).view(1, count, -1)
            cache.length = total
            return self.final_norm(hidden)
        masks: dict[str, torch.Tensor | None] = {}
        for index, layer in enumerate(self.layers):
            layer_type = self.layer_types[index]
            window = self.window if layer_type == "sliding_attention" else None
            if layer_type not in masks:
                masks[layer_type] = causal_mask(past, count, window)
            mask = masks[layer_type]

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int = index,
                       mask: torch.Tensor | None = mask) -> torch.Tensor:
                if cache is not None:
                    cache.write(index, past, self._cached(k), self._cached(v))
                    k, v = (t.to(q.dtype) for t in cache.read(index, total))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      scale=self.scaling, enable_gqa=self.heads != self.kv_heads)

            cos, sin = rope[layer_type]
            hidden = self._block(layer, hidden, attend, cos, sin)
        if cache is not None:
            cache.length = total
        return self.final_norm(hidden)

    # -- several sessions' one-token steps at once -----------------------------

    def run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: Sequence[LeanCache]) -> torch.Tensor:
        """Rows `[rows, 1, hidden]`, row r at `positions[r, 0]` of session cache `caches[r]`: projections, MLPs
        and norms on all rows at once, each row attending to its own cache. Every row's cache is grown before
        any is written, so a failure (out of memory) leaves them all as they were."""
        return self._run_rows(hidden, positions, caches)

    def _run_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: Sequence[LeanCache]) -> torch.Tensor:
        # (a lone session's decode step comes here too, from `run`: the same arithmetic, whatever befalls batches)
        flat = positions[:, 0]
        pasts = [int(p) for p in flat]
        for cache, past in zip(caches, pasts):
            _room(cache, past, past + 1)
        rope = self.rope(flat, max(pasts) + 1)
        threads = torch.get_num_threads()
        if self.fused is not None and len(caches) <= self.fused_rows:  # every layer in one call of the kernel
            hidden = self.fused.run(hidden, *rope[self.layer_types[0]], caches, pasts, kernel_threads())
            for cache, past in zip(caches, pasts):
                cache.length = past + 1
            return self.final_norm(hidden)
        rows = None if self.kernels is None else AttendRows.per_type(caches, pasts, self.layer_types, self.window,
                                                                    self.scaling)
        for index, layer in enumerate(self.layers):
            layer_type = self.layer_types[index]
            window = self.window if layer_type == "sliding_attention" else None

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int = index,
                       window: int | None = window) -> torch.Tensor:
                if rows is not None:  # one kernel for all rows, each on its own cache (writes them too)
                    return self.kernels.attend(q, self._cached(k), self._cached(v), rows[self.layer_types[index]],
                                               index, threads).to(q.dtype)
                outputs = []
                for row, (cache, past) in enumerate(zip(caches, pasts)):
                    cache.write(index, past, self._cached(k[row : row + 1]), self._cached(v[row : row + 1]))
                    low = max(0, past + 1 - window) if window else 0
                    keys, values = (t.to(q.dtype) for t in cache.read(index, past + 1, low))
                    outputs.append(F.scaled_dot_product_attention(  # (a group's query heads share a key head)
                        q[row : row + 1], keys, values, scale=self.scaling, enable_gqa=self.heads != self.kv_heads))
                return torch.cat(outputs)

            cos, sin = rope[layer_type]
            hidden = self._block(layer, hidden, attend, cos.unsqueeze(1).unsqueeze(1), sin.unsqueeze(1).unsqueeze(1))
        for cache, past in zip(caches, pasts):
            cache.length = past + 1
        return self.final_norm(hidden)


def _room(cache: LeanCache, past: int, total: int) -> None:
    """A step from `past` to `total` needs the cache to hold `past` positions, and room up to `total`."""
    if cache.length < past:
        raise KVCacheMiss(f"the cache holds {cache.length} positions, the step starts at {past}")
    cache.reserve(total, past)
