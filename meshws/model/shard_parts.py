"""What a shard is made of, loaded one of two ways: a GGUF's blocks on the lean path, or a transformers model.

`gguf_parts`: the file mapped (`gguf_model`), the span's layers on its blocks (`lean_weights`), the
embeddings widened a row at a time on lookup, the tail's LM head on its blocks: nothing converted,
nothing written but the tokenizer's files. Where the lean path cannot run (an architecture it does not
know, a block type the kernels lack, no C compiler, `--compute transformers`), `transformers_parts`
builds the span's transformers model, a GGUF's weights dequantized in memory, and says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .kernels import blas
from .backend import ShardBackend
from .batched import RowRunner, Rows
from .gguf.block_types import BlockTensor, supported_names
from .gguf.gguf_model import Architecture, GgufModel
from .lean import LeanLayers
from .lean_weights import embedding_rows, lean_from_gguf, lean_from_modules
from .kernels.native import Kernels, kernels
from .kernels.native import threads as kernel_threads
from .kernels.packed import int8_kernel_runs
from .kernels.paths import choose_paths
from .settings import ShardLayout, ShardSettings
from .source import ResolvedModel, model_cache
from .tensors import TORCH_DTYPES
from .weights import load_shard_model, shard_config

log = logging.getLogger("meshws.shard")

__all__ = ["ShardParts", "gguf_parts", "lean_problem", "transformers_parts", "ShardBackend"]


@dataclass
class ShardParts:
    """A shard's layers and what surrounds them."""

    layout: ShardLayout
    hidden_size: int
    vocab_size: int
    context_length: int
    compute_dtype: torch.dtype  # of hidden states between layers and from the wire
    run: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # (hidden, positions, cache or None)
    new_cache: Callable[[], Any]
    rows: Rows
    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [n] -> [n, hidden]
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None  # a tail's: last hidden -> logits
    lean: LeanLayers | None = None
    model: Any = None  # the transformers model (its path), or the part a lean shard keeps (embeddings)
    gguf: GgufModel | None = None
    eos_ids: list[int] = field(default_factory=list)
    softcap: float | None = None
    path: str = "transformers"  # what runs the layers, for `/health`
    fallback: str = ""  # why a GGUF runs on the transformers path, if it does
    matmul: tuple[str, str] = ("torch", "decode runs on meshws's kernel (prefill on torch)")  # float products: how, why


def lean_problem(model: GgufModel, arch: Architecture | None, native: Kernels | None, settings: ShardSettings) -> str:
    """Why the lean path cannot run this GGUF here ("" when it can)."""
    if settings.compute == "transformers":
        return "--compute transformers"
    if arch is None:
        return f"the lean path does not run {model.table.architecture} (it runs llama, qwen2, qwen3, gemma3)"
    if native is None:
        return "meshws's kernels could not be built (no C compiler?)"
    if settings.quant:
        return "--quant int8 applies to float weights; a GGUF's blocks are its weights"
    unknown = sorted({t.ggml_type for t in model.table.tensors.values()} - set(native.block_types) - {0, 1, 30})
    if unknown:
        from .gguf.block_types import type_name

        return (f"its tensors include {', '.join(type_name(t) for t in unknown)}; the kernels compute on "
                f"{supported_names(native.block_types)}")
    return ""


def gguf_parts(resolved: ResolvedModel, model: GgufModel, arch: Architecture, layout: ShardLayout,
               settings: ShardSettings, native: Kernels) -> ShardParts:
    """A GGUF's span on its own blocks: products with 8-bit activations unless float32 was asked for."""
    q8 = settings.dtype_was_auto or settings.dtype != "float32"
    blas.take_threads(*ShardParts.matmul, settings.threads)
    lean = lean_from_gguf(model, arch, layout.start, layout.end, layout.is_tail, q8, native)
    table: BlockTensor | None = model.tensor("token_embd.weight") if layout.is_head else None
    scale = torch.tensor(arch.hidden ** 0.5, dtype=torch.float32) if arch.gemma else None

    def embed(ids: torch.Tensor) -> torch.Tensor:
        if table is None:
            raise RuntimeError("only a head shard holds the embeddings")
        rows = embedding_rows(table, ids, native)
        return rows * scale if scale is not None else rows

    meta = model.metadata
    eos = [meta[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if isinstance(meta.get(key), int)]
    model.prefetch()  # the span's pages, read ahead while the node starts
    if q8:  # where a type's products have two paths, this CPU's own crossing (`paths`)
        choose_paths(native, lean.block_weights(), kernel_threads())
    return ShardParts(
        layout=layout, hidden_size=arch.hidden, vocab_size=arch.vocab, context_length=arch.context,
        compute_dtype=lean.dtype, run=lean.run, new_cache=lean.new_cache, rows=lean, embed=embed,
        lm_head=lean.logits if lean.lm_head is not None else None, lean=lean, gguf=model,
        eos_ids=list(dict.fromkeys(eos)), path=lean.describe())


def transformers_parts(resolved: ResolvedModel, settings: ShardSettings, start: int, end: int | None,
                       fallback: str = "") -> ShardParts:
    """The span as a transformers model (a folder's weights mapped, a GGUF's dequantized in memory), on the lean
    path where its architecture has one and the weights are a folder's."""
    from transformers import AutoConfig, DynamicCache

    cache = model_cache(resolved)
    if cache is not None:
        cache.prepare(["config"])  # (a child process: transformers' GGUF config)
    config = AutoConfig.from_pretrained(str(resolved.folder))
    total = config.num_hidden_layers
    end = total if end is None else end
    if not 0 <= start < end <= total:
        raise ValueError(f"layer range [{start}, {end}) is not within the model's {total} layers")
    layout, dtype = ShardLayout(total, start, end), TORCH_DTYPES[settings.dtype]
    layers_config = shard_config(config, start, end)
    model = load_shard_model(resolved, layers_config, layout, settings.dtype)
    lean, matmul = _module_lean(model, settings, resolved.model_id, allowed=not fallback)
    base = model.model
    parts = ShardParts(
        layout=layout, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        context_length=getattr(config, "max_position_embeddings", None) or 2048, compute_dtype=dtype,
        run=lean.run if lean else _transformers_run(model),
        new_cache=lean.new_cache if lean else (lambda: DynamicCache(config=layers_config)),
        rows=lean if lean else RowRunner(model), embed=lambda ids: base.embed_tokens(ids.view(1, -1))[0],
        lm_head=None, lean=lean, model=model, softcap=getattr(config, "final_logit_softcapping", None),
        path=lean.describe() if lean else "transformers", fallback=fallback, matmul=matmul)
    if layout.is_tail:
        parts.lm_head = lean.logits if lean is not None and lean.lm_head is not None else model.lm_head
    return parts


def _transformers_run(model: Any) -> Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]:
    def run(hidden: torch.Tensor, position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        output = model.model(inputs_embeds=hidden, position_ids=position_ids, cache=cache, use_cache=cache is not None)
        return output.last_hidden_state

    return run


def _module_lean(model: Any, settings: ShardSettings, model_id: str,
                 allowed: bool) -> tuple[LeanLayers | None, tuple[str, str]]:
    """Pack a folder model's layers for the lean path (letting go of transformers' copies), or None; and what
    multiplies float weights, and why."""
    wanted, quant = (settings.compute if allowed else "transformers"), settings.quant
    native = kernels() if wanted != "transformers" else None  # decode attention, and int8 products
    if quant == "int8" and native is None and not int8_kernel_runs():
        raise ValueError("int8 weights need a C compiler (meshws's kernel) or FBGEMM (torch on an x86 CPU)")
    matmul = blas.choose_matmul(settings.matmul, quant or settings.dtype, settings.compile)
    lean = None if wanted == "transformers" else lean_from_modules(  # fused: decode steps in one kernel call
        model, TORCH_DTYPES[settings.dtype], quant, matmul[0] == "openblas", native,
        fused=settings.matmul != "openblas" and not settings.compile)
    chosen = matmul if lean is not None and not lean.fused else (
        "torch", "the transformers path" if lean is None else "decode runs on meshws's kernel (prefill on torch)")
    blas.take_threads(*chosen, settings.threads)
    if lean is None:
        if allowed and (wanted == "lean" or quant):
            raise ValueError(f"{model_id} ({model.config.model_type}) has no lean path" + " for int8" * bool(quant))
        return None, chosen
    model.model.layers = torch.nn.ModuleList()  # the packed copies replace them
    if lean.lm_head is not None:  # the packed LM head replaces the module's
        embed = model.model.embed_tokens
        if embed is not None and embed.weight.data_ptr() == model.lm_head.weight.data_ptr() \
                and lean.lm_head.weight is not None:  # tied, float: the embeddings read the packed copy (one copy)
            embed.weight = torch.nn.Parameter(lean.lm_head.weight, requires_grad=False)
        model.lm_head = None
    model.model.norm = torch.nn.Identity()  # the lean layers hold it
    return lean, chosen
