"""The lean path: a shard's decoder layers run over its own packed weights, without transformers' modules.

For the architectures meshws knows (Llama-style, e.g. SmolLM2; Gemma-3) the layers are
repacked once at load: q/k/v fused into one matrix, gate/up into one, norm weights
prepared (Gemma's `1 + w`), rotary tables computed once per layer type. A session's
keys and values live in `LeanCache`: per-layer buffers grown in blocks and written in
place, so a decode step allocates no cache objects. A Llama-style decode step, for one
session or a batch of them, is one call of meshws's kernel through every layer
(`fused.FusedDecode`). Otherwise a decode step's attention is one kernel call per layer
over every row's own cache (`native.Kernels.attend`; torch's sdpa row by row where the
kernel cannot be built);
prefill attention is torch's `scaled_dot_product_attention`. The rest follows
transformers' own modules operation by operation, so fp32 tokens are the transformers path's.

`--quant int8` stores every linear weight as int8 with one scale per output channel and
runs it on meshws's kernel (float32 activations), else FBGEMM's int8 GEMM (`packed.linear`).
Float32 weights may be multiplied by numpy's OpenBLAS instead of torch's MKL (`blas`, `--matmul`).

Another architecture (or one with features the lean path lacks, such as attention
logit soft-capping) gets `None` from `lean_layers` and keeps the transformers path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .cache_store import KVCacheMiss
from .fused import FusedDecode
from .native import AttendRows, Kernels
from .native import threads as kernel_threads
from .packed import LeanCache, Linear, linear, pack_linear
from .tensors import causal_mask, rotate_half

# Rows a fused step takes (sessions, or a lap of drafts); the LM head a quarter. torch's AVX512-BF16 products beat
# the kernel's beyond: 16 rows x the LM head 3.9 ms on torch, 6.8 on the kernel (fp32: 14.5 against 8.0).
FUSED_ROWS = {torch.bfloat16: 8, torch.float32: 64}


def _cat_bias(*modules: Any) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(m.weight.shape[0]) for b, m in zip(biases, modules)])


class _Layer:
    """One decoder layer's packed weights."""

    def __init__(self, module: Any, kind: str, dtype: torch.dtype, quant: str | None, openblas: bool,
                 native: Kernels | None, plain: bool) -> None:
        attn, mlp = module.self_attn, module.mlp
        how = (dtype, quant, openblas, native, plain)
        self.qkv = pack_linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                               _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), *how)
        self.o = pack_linear(attn.o_proj.weight, attn.o_proj.bias, *how)
        self.gate_up = pack_linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                   _cat_bias(mlp.gate_proj, mlp.up_proj), *how)
        self.down = pack_linear(mlp.down_proj.weight, mlp.down_proj.bias, *how)
        # In order: input, post-attention (Gemma: then pre- and post-feedforward, q and k norms).
        names = ["input_layernorm", "post_attention_layernorm"]
        if kind == "gemma3":
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        weights = [getattr(module, name).weight for name in names]
        if kind == "gemma3":
            weights += [attn.q_norm.weight, attn.k_norm.weight]
        self.norms = tuple(_norm_weight(weight, kind, dtype) for weight in weights)

    def tensors(self) -> list[torch.Tensor]:
        found = [t for packed in self.linears() for t in packed.tensors()]
        return found + list(self.norms)

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def _norm_weight(weight: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "gemma3":  # Gemma multiplies in fp32 by (1 + w), then casts
        return (1.0 + weight.detach().float()).contiguous()
    return weight.detach().to(dtype).contiguous()


def architecture(config: Any) -> str | None:
    """Which lean path fits `config`: "llama", "gemma3", or None (the transformers path)."""
    if getattr(config, "attn_logit_softcapping", None):
        return None
    model_type = getattr(config, "model_type", "")
    if model_type == "llama" and getattr(config, "hidden_act", "silu") == "silu":
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
            return None
        return "llama"
    if model_type == "gemma3_text" and getattr(config, "hidden_activation", "") == "gelu_pytorch_tanh":
        if getattr(config, "use_bidirectional_attention", False):
            return None
        return "gemma3"
    return None


class LeanLayers:
    """A shard's decoder layers (and its final norm) on packed weights; also the batched-rows runner."""

    fits = True  # batched decode runs through `run_rows`
    compiled = False

    def __init__(self, model: Any, kind: str, dtype: torch.dtype, quant: str | None = None,
                 openblas: bool = False, native: Kernels | None = None, fused: bool = True) -> None:
        base, config = model.model, model.config
        self.kind, self.dtype, self.quant = kind, dtype, quant
        fused = fused and native is not None and kind == "llama" and len(base.layers) > 0  # one call (`fused`)
        self.openblas = openblas and dtype == torch.float32 and quant is None and not fused  # on OpenBLAS
        self.kernels = native  # decode attention on meshws's kernel (else torch's sdpa, row by row)
        self.native = native if quant == "int8" else None  # int8 products on meshws's kernel, else FBGEMM's
        self.attention = "meshws kernel" if native else "torch sdpa"
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        if kind == "gemma3":
            self.scaling = config.query_pre_attn_scalar ** -0.5
            self.layer_types = list(config.layer_types)
            self.window = config.sliding_window
        else:
            self.scaling = self.head_dim ** -0.5
            self.layer_types = ["full_attention"] * len(base.layers)
            self.window = None
        self.layers = []
        for index, module in enumerate(base.layers):  # each layer's mapped file is let go once packed
            self.layers.append(_Layer(module, kind, dtype, quant, self.openblas, self.native, fused))
            base.layers[index] = torch.nn.Identity()
        self.final_norm = base.norm  # identity on a shard that is not the tail
        self._rotary = base.rotary_emb
        self._rotary_by_type = kind == "gemma3"
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._before = self._before_attention  # or their compiled versions (`compiled.compile_lean`)
        self._after = self._after_attention
        self.lm_head: Linear | None = None
        if getattr(model, "lm_head", None) is not None:  # the tail's LM head, packed like the layers
            self.lm_head = pack_linear(model.lm_head.weight, model.lm_head.bias, dtype, quant, self.openblas,
                                       self.native, fused)
        self.fused = FusedDecode(self, native) if fused and native is not None else None
        # On AMX tiles a batch of bf16 rows costs the kernel little more than one row: every batch runs fused.
        self.fused_rows = 64 if quant or (self.fused and self.fused.amx) else FUSED_ROWS.get(dtype, 0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The packed LM head (a tail only); on meshws's kernel where decode is, if it takes these rows."""
        assert self.lm_head is not None
        out = None if self.fused is None else self.fused.logits(hidden, self.lm_head, self.fused_rows // 4)
        return linear(hidden, self.lm_head) if out is None else out

    def describe(self) -> str:
        kernel = " (meshws kernel)" if self.native else " (FBGEMM)"
        return (f"lean {self.kind}" + (f", {self.quant} weights{kernel}" if self.quant else "")
                + (", decode fused (meshws kernel)" if self.fused else "")
                + (", bf16 products on AMX tiles" if self.fused and self.fused.amx else "")
                + (", float32 weights as GGUF codes" if self.fused and self.fused.blocks else "")
                + (", OpenBLAS products" if self.openblas else "") + (", compiled" if self.compiled else ""))

    def _linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head] * (self.lm_head is not None)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held, all of them parameters (int8 matrices are not tensors: `int8_bytes`)."""
        return [t for lin in self._linears() for t in lin.tensors()] + [n for layer in self.layers for n in layer.norms]

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
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    # -- rotary tables ---------------------------------------------------------

    def _table(self, layer_type: str, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[positions, head_dim]` for positions 0..needed-1 at least (computed once, grown by doubling)."""
        table = self._tables.get(layer_type)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * table[0].shape[0] if table is not None else 1024)
            ids = torch.arange(size, dtype=torch.long).unsqueeze(0)
            probe = torch.empty(0, dtype=self.dtype)
            if self._rotary_by_type:
                cos, sin = self._rotary(probe, ids, layer_type)
            else:
                cos, sin = self._rotary(probe, position_ids=ids)
            table = (cos[0].contiguous(), sin[0].contiguous())
            self._tables[layer_type] = table
        return table

    def rope(self, positions: torch.Tensor, needed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, cos and sin for `positions` (flat), shaped to broadcast over `[rows, heads, T, dim]`."""
        found = {}
        for layer_type in set(self.layer_types):
            cos, sin = self._table(layer_type, needed)
            found[layer_type] = (cos[positions], sin[positions])
        return found

    # -- the arithmetic, as transformers does it -------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "gemma3":
            return (normed * weight).type_as(x)
        return weight * normed.to(x.dtype)

    def _mlp(self, x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
        gate, up = linear(x, gate_up).chunk(2, dim=-1)
        if self.kind == "gemma3":
            return linear(F.gelu(gate, approximate="tanh") * up, down)
        return linear(F.silu(gate) * up, down)

    def _before_attention(self, hidden: torch.Tensor, norms: tuple[torch.Tensor, ...], qkv: Linear,
                          cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, projections and rotary: q `[rows, heads, T, dim]`, k and v `[rows, kv_heads, T, dim]`."""
        rows, count = hidden.shape[0], hidden.shape[1]
        x = self._norm(hidden, norms[0])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = linear(x, qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(rows, count, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(rows, count, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(rows, count, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kind == "gemma3":
            q = self._norm(q, norms[-2])
            k = self._norm(k, norms[-1])
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def _after_attention(self, hidden: torch.Tensor, attended: torch.Tensor, norms: tuple[torch.Tensor, ...],
                         o: Linear, gate_up: Linear, down: Linear) -> torch.Tensor:
        """Output projection, residuals, norms and MLP."""
        rows, count = hidden.shape[0], hidden.shape[1]
        out = linear(attended.transpose(1, 2).reshape(rows, count, self.heads * self.head_dim), o)
        if self.kind == "gemma3":
            hidden = hidden + self._norm(out, norms[1])
            x = self._norm(hidden, norms[2])
            return hidden + self._norm(self._mlp(x, gate_up, down), norms[3])
        hidden = hidden + out
        return hidden + self._mlp(self._norm(hidden, norms[1]), gate_up, down)

    def _block(self, layer: _Layer, hidden: torch.Tensor, attend: Callable[[torch.Tensor, torch.Tensor,
               torch.Tensor], torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self._before(hidden, layer.norms, layer.qkv, cos, sin)
        return self._after(hidden, attend(q, k, v), layer.norms, layer.o, layer.gate_up, layer.down)

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
                       window: int | None = window, mask: torch.Tensor | None = mask) -> torch.Tensor:
                if cache is not None:
                    cache.keys[index][:, :, past:total] = k
                    cache.values[index][:, :, past:total] = v
                    k = cache.keys[index][:, :, :total]
                    v = cache.values[index][:, :, :total]
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
                    return self.kernels.attend(q, k, v, rows[self.layer_types[index]], index, threads)
                outputs = []
                for row, (cache, past) in enumerate(zip(caches, pasts)):
                    cache.keys[index][:, :, past : past + 1] = k[row : row + 1]
                    cache.values[index][:, :, past : past + 1] = v[row : row + 1]
                    low = max(0, past + 1 - window) if window else 0
                    outputs.append(F.scaled_dot_product_attention(  # (a group's query heads share a key head)
                        q[row : row + 1], cache.keys[index][:, :, low : past + 1],
                        cache.values[index][:, :, low : past + 1], scale=self.scaling,
                        enable_gqa=self.heads != self.kv_heads))
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
    cache.reserve(total)


def lean_layers(model: Any, dtype: torch.dtype, quant: str | None = None, openblas: bool = False,
                native: Kernels | None = None, fused: bool = True) -> LeanLayers | None:
    """The lean path for this shard's model, or None if its architecture has none."""
    kind = architecture(model.config)
    if kind is None:
        return None
    return LeanLayers(model, kind, dtype, quant, openblas, native, fused)

