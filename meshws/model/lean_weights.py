"""The lean path's layers, built from a GGUF's blocks as stored or from a Hugging Face model's float weights.

`lean_from_gguf`: each linear is the file's tensor (`BlockTensor`, a view of the mapping; nothing is
widened or copied), q, k and v (and gate and up) stay three (two) matrices, norms and biases are small
float32 copies. Gemma's norm weights are stored as 1 + w, as llama.cpp's converter writes them, which
is what the lean path multiplies by. With `q8` the block products quantize their activations to 8 bits
(llama.cpp's way: `quants.c`) and keys and values are kept in bfloat16; otherwise the blocks widen
exactly to the float32 weights transformers dequantizes, and everything is float32.

`lean_from_modules`: a Hugging Face model's layers, packed once (q/k/v and gate/up concatenated, float
or int8 weights: `packed.pack_linear`); transformers' copies are let go as each layer is packed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .gguf.block_types import BlockTensor
from .gguf.gguf_model import Architecture, GgufModel
from .lean import LayerWeights, LeanLayers, LeanSpec, RopeTable
from .kernels.native import Kernels
from .kernels.packed import Linear, block_linear, pack_linear


def gguf_rope(arch: Architecture) -> RopeTable:
    """cos and sin `[positions, head_dim]` per layer type, with transformers' arithmetic (exact in float32)."""

    def table(layer_type: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(size, dtype=torch.int64).float(), arch.inverse_frequencies(layer_type))
        both = torch.cat((freqs, freqs), dim=-1)
        return both.cos(), both.sin()

    return table


def lean_from_gguf(model: GgufModel, arch: Architecture, start: int, end: int, tail: bool, q8: bool,
                   native: Kernels) -> LeanLayers:
    """Layers `[start, end)` of a GGUF (and, on a tail, the final norm and LM head) on its blocks."""
    products = "q8" if q8 else "exact"
    types: Counter[str] = Counter()

    def linear(name: str) -> Linear:
        blocks = model.tensor(f"{name}.weight")
        types[blocks.type_name] += 1
        bias = model.vector(f"{name}.bias") if model.has(f"{name}.bias") else None
        return block_linear(blocks, bias, native, products)

    def vector(name: str) -> torch.Tensor | None:
        return model.vector(name) if model.has(name) else None

    layers = []
    for index in range(start, end):
        p = f"blk.{index}."
        norms = [p + "attn_norm.weight", p + "ffn_norm.weight"]
        if arch.gemma:
            norms = [p + "attn_norm.weight", p + "post_attention_norm.weight", p + "ffn_norm.weight",
                     p + "post_ffw_norm.weight"]
        layers.append(LayerWeights(
            qkv=(linear(p + "attn_q"), linear(p + "attn_k"), linear(p + "attn_v")), o=linear(p + "attn_output"),
            gate_up=(linear(p + "ffn_gate"), linear(p + "ffn_up")), down=linear(p + "ffn_down"),
            norms=tuple(model.vector(name) for name in norms), q_norm=vector(p + "attn_q_norm.weight"),
            k_norm=vector(p + "attn_k_norm.weight")))
    final_norm = lm_head = None
    if tail:
        final_norm = model.vector("output_norm.weight")
        lm_head = linear("token_embd" if arch.tied else "output")
    spec = LeanSpec(
        kind="gemma3" if arch.gemma else "llama", dtype=torch.float32,
        cache_dtype=torch.bfloat16 if q8 else torch.float32, heads=arch.heads, kv_heads=arch.kv_heads,
        head_dim=arch.head_dim, eps=arch.eps, scaling=arch.scaling, layer_types=arch.layer_types[start:end],
        window=arch.window, rope=gguf_rope(arch), rope_pairs=arch.rope_pairs, q8=q8,
        weights=f"GGUF blocks ({', '.join(f'{name} x {count}' for name, count in sorted(types.items()))}), "
                + ("8-bit activations" if q8 else "widened exactly to float32"))
    return LeanLayers(spec, layers, final_norm, lm_head, native)


def embedding_rows(table: BlockTensor, ids: torch.Tensor, native: Kernels | None) -> torch.Tensor:
    """Rows `ids` of an embedding matrix as float32, widened on lookup (exactly as gguf dequantizes them)."""
    if not table.quantized:
        return table.as_float()[ids].float()
    if native is None:
        raise ValueError(f"{table.name} is {table.type_name}: widening it needs meshws's kernels")
    return native.widen(table, ids)


# -- a Hugging Face model's modules ---------------------------------------------


def module_architecture(config: Any) -> str | None:
    """Which lean path fits a transformers config: "llama", "gemma3", or None (the transformers path)."""
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


def _cat_bias(*modules: Any) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(m.weight.shape[0]) for b, m in zip(biases, modules)])


def _norm_weight(weight: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "gemma3":  # Gemma multiplies in fp32 by (1 + w), then casts
        return (1.0 + weight.detach().float()).contiguous()
    return weight.detach().to(dtype).contiguous()


def _module_layer(module: Any, kind: str, dtype: torch.dtype, quant: str | None, openblas: bool,
                  native: Kernels | None, plain: bool) -> LayerWeights:
    attn, mlp = module.self_attn, module.mlp
    how = (dtype, quant, openblas, native if quant == "int8" else None, plain)
    names = ["input_layernorm", "post_attention_layernorm"]
    if kind == "gemma3":
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    gemma = kind == "gemma3"
    return LayerWeights(
        qkv=(pack_linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                         _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), *how),),
        o=pack_linear(attn.o_proj.weight, attn.o_proj.bias, *how),
        gate_up=(pack_linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                             _cat_bias(mlp.gate_proj, mlp.up_proj), *how),),
        down=pack_linear(mlp.down_proj.weight, mlp.down_proj.bias, *how),
        norms=tuple(_norm_weight(getattr(module, name).weight, kind, dtype) for name in names),
        q_norm=_norm_weight(attn.q_norm.weight, kind, dtype) if gemma else None,
        k_norm=_norm_weight(attn.k_norm.weight, kind, dtype) if gemma else None)


def lean_from_modules(model: Any, dtype: torch.dtype, quant: str | None = None, openblas: bool = False,
                      native: Kernels | None = None, fused: bool = True) -> LeanLayers | None:
    """The lean path for a transformers model's shard (its layers let go as they are packed), or None if its
    architecture has none."""
    base, config = model.model, model.config
    kind = module_architecture(config)
    if kind is None:
        return None
    fused = fused and native is not None and kind == "llama" and len(base.layers) > 0
    openblas = openblas and dtype == torch.float32 and quant is None and not fused
    layers = []
    for index, module in enumerate(base.layers):  # each layer's mapped file is let go once packed
        layers.append(_module_layer(module, kind, dtype, quant, openblas, native, fused))
        base.layers[index] = torch.nn.Identity()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary = base.rotary_emb

    def rope(layer_type: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, probe = torch.arange(size, dtype=torch.long).unsqueeze(0), torch.empty(0, dtype=torch.float32)
        cos, sin = rotary(probe, ids, layer_type) if kind == "gemma3" else rotary(probe, position_ids=ids)
        return cos[0].contiguous(), sin[0].contiguous()

    final_norm = None
    if isinstance(base.norm, torch.nn.Module) and hasattr(base.norm, "weight"):
        final_norm = _norm_weight(base.norm.weight, kind, dtype)
    lm_head = None
    if getattr(model, "lm_head", None) is not None:  # the tail's LM head, packed like the layers
        lm_head = pack_linear(model.lm_head.weight, model.lm_head.bias, dtype, quant, openblas,
                              native if quant == "int8" else None, fused)
    spec = LeanSpec(
        kind=kind, dtype=dtype, cache_dtype=dtype, heads=heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim, eps=config.rms_norm_eps,
        scaling=config.query_pre_attn_scalar ** -0.5 if kind == "gemma3" else head_dim ** -0.5,
        layer_types=tuple(config.layer_types) if kind == "gemma3" else ("full_attention",) * len(layers),
        window=config.sliding_window if kind == "gemma3" else None, rope=rope)
    return LeanLayers(spec, layers, final_norm, lm_head, native, fused, quant, openblas)
