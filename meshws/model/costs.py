"""What each part of a model costs a node: bytes per layer, the embeddings, the LM head, and KV per token.

Placement (`head.placement`) weighs spans by these numbers: a node's memory budget must hold the bytes of
the weights it maps (the embeddings on the head, the LM head on the tail) and a reserve of KV cache, and
decode time on a CPU follows the bytes a step reads, so a span's compute counts in *mean layers*: its bytes
over the mean decoder layer's (the LM head of a 1B Llama in Q6_K is about two layers' worth, though it runs
faster or slower per byte than they do: `head.placement` scales it by what tails measure), plus a step's
fixed work (`STEP_BYTES`: Python, frames, the worker's turn), which dominates on a small model and a short
span. The numbers come from the GGUF's tensor table (or a folder's safetensors headers) without reading a weight.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
FOLDER_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
GGUF_EMBEDDINGS, GGUF_LM_HEAD, GGUF_FINAL_NORM = "token_embd.weight", "output.weight", "output_norm.weight"
FOLDER_EMBEDDINGS, FOLDER_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
FOLDER_FINAL_NORM = "model.norm.weight"
STEP_BYTES = 4 * 2**20  # a step's fixed work, counted as bytes read (about 0.3 ms of a 2020s core, as SmolLM2 shows)
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class ModelCosts:
    """Bytes of each part of one model, and the KV cache's bytes per token and layer."""

    layer_bytes: tuple[int, ...]  # each decoder layer's tensors
    embedding_bytes: int  # the token embeddings, mapped by the head
    lm_head_bytes: int  # the final norm and the LM head (the embeddings again when tied), mapped by the tail
    kv_bytes_per_token: int  # keys and values of one position in one layer

    @property
    def total_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def mean_layer_bytes(self) -> float:
        return sum(self.layer_bytes) / max(1, len(self.layer_bytes))

    def weight_bytes(self, start: int, end: int) -> int:
        """The bytes a node serving `[start, end)` maps: its layers, plus the embeddings from layer 0, plus the LM
        head through the last layer."""
        return sum(self.layer_bytes[start:end]) + (self.embedding_bytes if start == 0 else 0) + \
            (self.lm_head_bytes if end == self.total_layers else 0)

    def units(self, start: int, end: int) -> float:
        """A decode step's work on the layers `[start, end)` in mean layers: the bytes it reads over a mean layer's,
        and its fixed work (the head's embeddings are one row per token, nothing; the tail's LM head is apart)."""
        return (sum(self.layer_bytes[start:end]) + STEP_BYTES) / max(1.0, self.mean_layer_bytes)

    @property
    def lm_head_units(self) -> float:
        """The LM head's bytes in mean layers (its products run other kernels than the layers': a tail measures its
        time apart, `model.speed`)."""
        return self.lm_head_bytes / max(1.0, self.mean_layer_bytes)

    def describe(self) -> dict[str, object]:
        return {"layers": self.total_layers, "mean_layer_bytes": round(self.mean_layer_bytes),
                "embedding_bytes": self.embedding_bytes, "lm_head_bytes": self.lm_head_bytes,
                "kv_bytes_per_token_layer": self.kv_bytes_per_token}


def costs_from_sizes(sizes: dict[str, int], layers: int, kv_bytes_per_token: int, gguf: bool) -> ModelCosts:
    """Group tensor byte counts by part: layers by their index, the embeddings, and the final norm with the LM head
    (the embeddings when the model ties them)."""
    pattern = GGUF_LAYER if gguf else FOLDER_LAYER
    embeddings, lm_head, final_norm = (GGUF_EMBEDDINGS, GGUF_LM_HEAD, GGUF_FINAL_NORM) if gguf else \
        (FOLDER_EMBEDDINGS, FOLDER_LM_HEAD, FOLDER_FINAL_NORM)
    per_layer = [0] * layers
    for name, nbytes in sizes.items():
        match = pattern.match(name)
        if match and int(match.group(1)) < layers:
            per_layer[int(match.group(1))] += nbytes
    embedding_bytes = sizes.get(embeddings, 0)
    head = sizes.get(lm_head, embedding_bytes) + sizes.get(final_norm, 0)
    return ModelCosts(tuple(per_layer), embedding_bytes, head, kv_bytes_per_token)


def gguf_costs(path: Path, kv_element_bytes: float = 2) -> ModelCosts:
    """A GGUF's costs from its tensor table (no weight is read)."""
    from .gguf.gguf_file import geometry, read_table

    table = read_table(path)
    layers, hidden, heads, kv_heads = geometry(table)
    head_dim = int(table.metadata.get(f"{table.architecture}.attention.key_length", hidden // heads))
    sizes = {name: tensor.nbytes for name, tensor in table.tensors.items()}
    return costs_from_sizes(sizes, layers, 2 * kv_heads * head_dim * kv_element_bytes, gguf=True)


def folder_costs(folder: Path, layers: int, kv_heads: int, head_dim: int, kv_element_bytes: float = 2) -> ModelCosts:
    """A Hugging Face folder's costs from its safetensors headers (each file's first bytes only)."""
    return costs_from_sizes(dict(_safetensors_sizes(sorted(folder.glob("*.safetensors")))), layers,
                            2 * kv_heads * head_dim * kv_element_bytes, gguf=False)


def _safetensors_sizes(files: Iterable[Path]) -> Iterable[tuple[str, int]]:
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(min(length, 100 * 2**20)))
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            count = 1
            for dim in entry.get("shape", []):
                count *= int(dim)
            yield name, count * SAFETENSORS_BYTES.get(str(entry.get("dtype")), 2)
