"""GGUF tensors as Hugging Face tensors, one part (a decoder layer, the embeddings...) at a time.

The names and the values come out exactly as `from_pretrained(..., gguf_file=...)` makes
them, because the work is transformers' own: `get_gguf_hf_weights_map` maps GGUF names
to model names, and the architecture's `TensorProcessor` undoes llama.cpp's transforms
(Llama's Q/K permutation, Gemma's `norm + 1`). Only the loop differs: transformers
dequantises every tensor of the file into memory; here a part's tensors are read from
the memory-mapped file (`gguf_file`) and nothing else is touched.

A part is what one cache file holds: `model.layers.N` for every tensor of layer N, and
the module path (`model.embed_tokens`, `model.norm`, `lm_head`) for the others.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_file import GgufTable, dequantize, read_table

TENSOR_MAP = "meshws-tensors.json"  # in the cache folder: the GGUF -> model name map, written once
LAYER_PART = re.compile(r"^(.*\.layers\.\d+)\.")


def part_of(name: str) -> str:
    """The cache part a model tensor belongs to: its decoder layer, or its module."""
    match = LAYER_PART.match(name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def tensor_name_map(gguf: Path, skeleton: Any) -> dict[str, Any]:
    """{"architecture", "tensors": {GGUF name: model name}} for the tensors the file holds.

    `skeleton` is the whole model built on the meta device (it only lends its names).
    """
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    table = read_table(gguf)
    mapping = get_gguf_hf_weights_map(_FirstLevel(skeleton, 1), _processor(table.architecture, skeleton.config))
    return {"architecture": table.architecture,
            "tensors": {name: mapping[name] for name in table.tensors if name in mapping}}


class _FirstLevel:
    """A module as `get_gguf_hf_weights_map` walks it, down to its children only.

    The function maps the whole model's names, then each child's (for files written from
    a base model, e.g. Bloom's), recursing to every leaf module: 10 s for SmolLM2's 30
    layers. Below the first level the names are fragments no GGUF name matches, so the
    map is the same without them (checked on SmolLM2 and Gemma-3).
    """

    def __init__(self, module: Any, depth: int) -> None:
        self.module, self.depth = module, depth
        self.config = getattr(module, "config", None)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def named_children(self) -> list[tuple[str, Any]]:
        if self.depth <= 0:
            return []
        return [(name, _FirstLevel(child, self.depth - 1)) for name, child in self.module.named_children()]


def _processor(architecture: str, config: Any) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


class GgufTensors:
    """The model tensors a GGUF provides, converted a part at a time."""

    def __init__(self, gguf: Path, folder: Path) -> None:
        from transformers import AutoConfig

        names = json.loads((folder / TENSOR_MAP).read_text())
        self.table: GgufTable = read_table(gguf)
        self.to_model: dict[str, str] = names["tensors"]
        self.processor = _processor(names["architecture"], AutoConfig.from_pretrained(str(folder)))

    def names(self) -> set[str]:
        return set(self.to_model.values())

    def convert(self, part: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor of `part`, dequantised and transformed as transformers does, in `dtype`."""
        parsed: dict[str, Any] = {"tensors": {}}  # where a processor that merges tensors (MoE) puts them
        tensors: dict[str, torch.Tensor] = {}
        for gguf_name, model_name in self.to_model.items():
            if part_of(model_name) != part:
                continue
            result = self.processor.process(weights=dequantize(self.table, gguf_name), name=gguf_name,
                                            tensor_key_mapping=self.to_model, parsed_parameters=parsed)
            if result.name in self.to_model:
                weights = torch.from_numpy(np.ascontiguousarray(result.weights))
                tensors[self.to_model[result.name]] = weights.to(dtype)
        for name, tensor in parsed["tensors"].items():
            tensors[name] = tensor.to(dtype)
        if not tensors:
            raise KeyError(f"{self.table.path.name} holds no tensor of {part}")
        return tensors
