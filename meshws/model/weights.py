"""Reading one layer range's weights: a model with only those layers, renumbered from 0.

A shard's model is built empty (no memory) from the config with `end - start`
layers, then only its tensors are read: memory-mapped from a Hugging Face folder's
safetensors files, or, from a GGUF (the transformers path: an architecture the lean path
does not run), dequantized in memory a part at a time (`gguf_convert`) and nothing written.
Layer `start + i` of the checkpoint becomes layer `i`; the embeddings only on the head;
the final norm and the LM head (or the tied embedding matrix) only on the tail.
`layout` is anything with `start`, `end`, `is_head` and `is_tail`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from .source import ResolvedModel


def shard_config(config: Any, start: int, end: int) -> Any:
    shard_config = copy.deepcopy(config)
    shard_config.num_hidden_layers = end - start
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        shard_config.layer_types = list(layer_types[start:end])
    # Tying is done by hand below: a tail without embeddings still needs the LM head.
    shard_config.tie_word_embeddings = False
    return shard_config


def load_shard_model(resolved: ResolvedModel, shard_config: Any, layout: Any, dtype: str) -> Any:
    """A CausalLM holding only this shard's layers: their weights mapped from a folder's files, or a GGUF's
    dequantized in memory (the "config" part of its cache, `model_files`, names its tensors)."""
    from .gguf.gguf_convert import GgufTensors
    from .tensors import TORCH_DTYPES

    model = _empty_shard_model(shard_config, layout)
    gguf = GgufTensors(resolved.gguf, resolved.folder) if resolved.gguf is not None else None
    folder_files = _folder_tensor_files(resolved.folder) if gguf is None else {}
    available = gguf.names() if gguf is not None else set(folder_files)
    sources: dict[str, str] = {}  # name in the shard model -> name in the checkpoint
    for name, _ in model.named_parameters():
        source = _checkpoint_name(name, layout.start)
        if source == "lm_head.weight" and source not in available:
            source = "model.embed_tokens.weight"  # tied embeddings
        sources[name] = source
    missing = sorted(set(sources.values()) - available)
    if missing:
        raise RuntimeError(f"the checkpoint of {resolved.model_id} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    needed = set(sources.values())
    if gguf is not None:
        from .gguf.gguf_convert import part_of

        tensors = {name: tensor for part in sorted({part_of(name) for name in needed})
                   for name, tensor in gguf.convert(part, TORCH_DTYPES[dtype]).items() if name in needed}
    else:
        tensors = _read_tensors({name: folder_files[name] for name in needed})
    # Where the file's dtype is the compute dtype, `to` is a no-op and the tensor stays a view of the
    # file's memory map: co-located nodes share the page cache, and nothing is copied at start.
    state = {name: tensors[source].to(TORCH_DTYPES[dtype]) for name, source in sources.items()}
    model.load_state_dict(state, strict=True, assign=True)
    base = model.model
    if base.embed_tokens is not None and sources.get("lm_head.weight") == "model.embed_tokens.weight":
        model.lm_head.weight = base.embed_tokens.weight  # one copy for a full shard
    model.eval()
    return model


def _empty_shard_model(shard_config: Any, layout: Any) -> Any:
    """The shard's modules on the meta device: names and shapes, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(shard_config)
    if not layout.is_head:
        model.model.embed_tokens = None
    if not layout.is_tail:
        model.model.norm = torch.nn.Identity()
        model.lm_head = None
    return model


def _checkpoint_name(name: str, start: int) -> str:
    prefix = "model.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix) :].split(".", 1)
        return f"{prefix}{int(index) + start}.{rest}"
    return name


def _folder_tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file in a Hugging Face folder (its index, or every file's header)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {key: folder / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    keys: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                keys[key] = path
    return keys


def _read_tensors(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """The named tensors, each opened as a view of its file's memory map (safetensors maps files)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as handle:
            for name, where in files.items():
                if where == path:
                    tensors[name] = handle.get_tensor(name)
    return tensors


def eos_ids(folder: Path, config: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)

    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(str(folder)).eos_token_id)
    except (OSError, ValueError):
        pass
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids
