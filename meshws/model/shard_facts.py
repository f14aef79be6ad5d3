"""What a `ModelShard` tells of itself: how it computes, the weights it holds and maps, and what the model's
parts cost (`costs`, for placement). A part of `shard.ModelShard` kept in its own file; it reads the shard and
changes nothing.
"""

from __future__ import annotations

import functools
from math import prod
from typing import Any

import torch

from .kernels import blas
from .gguf.block_types import type_name
from .costs import ModelCosts, folder_costs, gguf_costs
from .memory import process_memory


class ShardFacts:
    """Facts of a shard (mixed into `ModelShard`, which owns every attribute used)."""

    compute_path = property(lambda self: self.parts.path + (f" (weights dequantized in memory: {self.parts.fallback})"
                                                            if self.parts.fallback else ""),
                            doc='What runs the layers: "lean llama, GGUF blocks (...)", or "transformers".')

    @property
    def compute_facts(self) -> dict[str, Any]:
        return {"path": self.compute_path, "dtype": self.settings.dtype, "dtype_reason": self.dtype_reason,
                "matmul": self.matmul, "matmul_reason": self.matmul_reason, "threads": blas.threads(),
                "attention": self.lean.attention if self.lean is not None else "transformers",
                "kv_dtype": str(self.lean.spec.cache_dtype).replace("torch.", "") if self.lean is not None else None,
                "compile_seconds": self.compile_seconds, **(self.lean.facts() if self.lean else {"products": {}})}

    def held_tensors(self) -> list[torch.Tensor]:
        """The weights this shard holds in memory (a GGUF's mapped blocks apart: `memory`)."""
        held = [] if self.model is None else [param for param in self.model.parameters()
                                              if param.device.type != "meta"]
        return held + (self.lean.tensors() if self.lean is not None else [])

    def memory(self) -> dict[str, Any]:
        """The bytes of weights this shard holds (and, from a GGUF, what `weight_facts` says), and the process's
        resident and peak resident bytes."""
        facts = self.weight_facts()
        return {"weight_bytes": self.weight_bytes, **process_memory(),
                **{f"weights_{key}": value for key, value in facts.items() if key.endswith("_bytes")},
                **({"block_types": facts["block_types"]} if "block_types" in facts else {})}

    def weight_facts(self) -> dict[str, Any]:
        """Where the weights are and what they cost: a GGUF's tensors mapped from the file (bytes mapped, bytes
        resident in this process now, bytes per block type), or a transformers model's tensors in memory."""
        gguf = self.parts.gguf
        if gguf is None:
            return {"source": "dequantized from the GGUF" if self.parts.fallback else "model folder",
                    "mapped_bytes": 0, "resident_bytes": self.weight_bytes}
        types: dict[str, int] = {}
        for name in gguf.handed_out:
            entry = gguf.table.tensors[name]
            kind = type_name(entry.ggml_type)
            types[kind] = types.get(kind, 0) + entry.nbytes
        return {"source": f"GGUF {gguf.path.name}, mapped", "mapped_bytes": gguf.mapped_bytes(),
                "resident_bytes": gguf.resident_bytes(), "block_types": dict(sorted(types.items()))}

    def parameter_count(self) -> int:
        """Parameters this shard holds (a tied matrix counts once; int8 scales are not parameters)."""
        unique = {tensor.data_ptr(): tensor.numel() for tensor in self.held_tensors()}
        if self.parts.gguf is not None:  # the file's tensors this shard maps (its norms' copies among them)
            gguf = self.parts.gguf
            return sum(prod(gguf.table.tensors[name].shape) for name in gguf.handed_out)
        return sum(unique.values()) + (self.lean.int8_parameters if self.lean is not None else 0)

    @functools.cached_property
    def costs(self) -> ModelCosts:
        """What each part of the model costs (`costs`): the span's work and bytes, for placement."""
        kv_bytes = {"q8_0": 34 / 32, "bfloat16": 2, "float32": 4}.get(self.settings.kv_dtype,
                                                                     4 if self.settings.dtype == "float32" else 2)
        if self.resolved.gguf is not None:
            return gguf_costs(self.resolved.gguf, kv_bytes)
        config = self.parts.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return folder_costs(self.resolved.folder, self.total_layers, getattr(config, "num_key_value_heads", heads),
                            head_dim, kv_bytes)
