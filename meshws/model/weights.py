"""Reading one layer range's weights: a model with only those layers, renumbered from 0.

A shard's model is built empty (no memory) from the config with `end - start`
layers, then only its tensors are read from the safetensors files: layer
`start + i` of the checkpoint becomes layer `i`; the embeddings only on the head;
the final norm and the LM head (or the tied embedding matrix) only on the tail.
`layout` is anything with `start`, `end`, `is_head` and `is_tail`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def shard_config(config: Any, start: int, end: int) -> Any:
    shard_config = copy.deepcopy(config)
    shard_config.num_hidden_layers = end - start
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        shard_config.layer_types = list(layer_types[start:end])
    # Tying is done by hand below: a tail without embeddings still needs the LM head.
    shard_config.tie_word_embeddings = False
    return shard_config


def build_shard_model(folder: Path, shard_config: Any, layout: Any, dtype: torch.dtype) -> Any:
    """A CausalLM holding only this shard's layers, with weights read from disk."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(shard_config)
    base = model.model
    if not layout.is_head:
        base.embed_tokens = None
    if not layout.is_tail:
        base.norm = torch.nn.Identity()
        model.lm_head = None

    available = _checkpoint_keys(folder)  # tensor name -> safetensors file
    sources: dict[str, str] = {}  # name in the shard model -> name in the checkpoint
    for name, _ in model.named_parameters():
        source = _checkpoint_name(name, layout.start)
        if source == "lm_head.weight" and source not in available:
            source = "model.embed_tokens.weight"  # tied embeddings
        sources[name] = source
    missing = sorted(set(sources.values()) - set(available))
    if missing:
        raise RuntimeError(f"the checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    tensors = _read_tensors(available, set(sources.values()))
    state = {name: tensors[source].to(dtype) for name, source in sources.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if base.embed_tokens is not None and sources.get("lm_head.weight") == "model.embed_tokens.weight":
        model.lm_head.weight = base.embed_tokens.weight  # one copy for a full shard
    model.eval()
    return model


def _checkpoint_name(name: str, start: int) -> str:
    prefix = "model.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix) :].split(".", 1)
        return f"{prefix}{int(index) + start}.{rest}"
    return name


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    keys: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                keys[key] = path
    return keys


def _read_tensors(available: dict[str, Path], names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(available[name] for name in names)):
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                if available[name] == path:
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
