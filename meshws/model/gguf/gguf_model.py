"""A GGUF file as a node's weights: its tensors mapped, never copied, and the facts its metadata gives the lean path.

`GgufModel` maps the file once (a private mapping: pages are the page cache's until touched, and only the
pages a node reads become its resident memory) and hands out `BlockTensor`s, views of the mapping in the
file's own blocks. A node asks for its own tensors only, so the layers it does not serve are never read.

`Architecture` is what the lean path needs to know of a model (`lean_architecture`), read from the
metadata as llama.cpp reads it: Llama (with Llama 3's rope frequencies, `rope_freqs.weight`), Qwen2 (q, k
and v biases), Qwen3 (per-head q and k norms), Gemma-3. Another architecture gives None: the
transformers path, on weights dequantized in memory.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .block_types import BlockTensor, block_size
from .gguf_file import GgufTable, geometry, read_table

LEAN_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
GEMMA_GLOBAL_EVERY = 6  # Gemma-3: every sixth layer attends globally, the others to a sliding window (llama.cpp's)
GEMMA_LOCAL_THETA = 10000.0  # Gemma-3's rope base on sliding-window layers (transformers' and llama.cpp's default)


@dataclass(frozen=True)
class Architecture:
    """A decoder-only model's shape and arithmetic, as the lean path runs it."""

    kind: str  # "llama", "qwen2", "qwen3" or "gemma3"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int
    eps: float
    rope_theta: float
    rope_pairs: bool  # rotate (2i, 2i + 1) (a GGUF's Llama rows, as llama.cpp stores them), else (i, i + dim / 2)
    rope_factor: float = 1.0  # linear rope scaling: positions divided by it
    rope_freqs: tuple[float, ...] | None = None  # Llama 3: per-frequency divisors (`rope_freqs.weight`)
    tied: bool = False  # the LM head is the embedding matrix
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "sliding_attention"
    window: int | None = None  # sliding attention's window
    local_theta: float | None = None  # the rope base of sliding-attention layers
    scaling: float = 0.0  # attention's score scale
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def gemma(self) -> bool:
        return self.kind == "gemma3"

    def inverse_frequencies(self, layer_type: str) -> torch.Tensor:
        """The rotary inverse frequencies of a layer type, in float32, computed as transformers computes them
        (then divided by Llama 3's factors where the file has them, as llama.cpp applies them)."""
        base = self.local_theta if layer_type == "sliding_attention" and self.local_theta else self.rope_theta
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.head_dim
        inverse = 1.0 / (base ** exponents)
        if self.rope_freqs is not None:
            inverse = inverse / torch.tensor(self.rope_freqs, dtype=torch.float32)
        if self.rope_factor != 1.0 and layer_type != "sliding_attention":
            inverse = inverse / self.rope_factor
        return inverse


class GgufModel:
    """One GGUF file, mapped: its table, its architecture facts, and its tensors as views of the mapping."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.table: GgufTable = read_table(self.path)
        with open(self.path, "rb") as handle:  # a private mapping: torch may wrap it writable; the file is not written
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.handed_out: set[str] = set()  # the tensors a node asked for: what it maps as its own

    @property
    def metadata(self) -> dict[str, Any]:
        return self.table.metadata

    def has(self, name: str) -> bool:
        return name in self.table.tensors

    def tensor(self, name: str) -> BlockTensor:
        """A tensor as stored: 1-d tensors as one row. KeyError for a name the file lacks; ValueError for a tensor
        whose byte count disagrees with its shape and type."""
        entry = self.table.tensors[name]
        rows = 1 if len(entry.shape) == 1 else int(torch.Size(entry.shape[:-1]).numel())
        columns = int(entry.shape[-1])
        elements, size = block_size(entry.ggml_type)
        if columns % elements or rows * (columns // elements) * size != entry.nbytes:
            raise ValueError(f"{self.path.name}: {name} holds {entry.nbytes} bytes, not a {rows} x {columns} tensor "
                             f"of its type")
        self.handed_out.add(name)
        data = self._bytes[entry.offset : entry.offset + entry.nbytes].view(rows, entry.nbytes // rows)
        return BlockTensor(name, entry.ggml_type, (rows, columns), data)

    def vector(self, name: str) -> torch.Tensor:
        """A small float tensor (a norm's weights, a bias) as float32 values: a copy, so the mapping's page is not
        kept for it."""
        block = self.tensor(name)
        if block.quantized:
            raise ValueError(f"{self.path.name}: {name} is {block.type_name}, not a float tensor")
        return block.as_float().reshape(-1).float().clone()

    def mapped_bytes(self) -> int:
        """Bytes of the tensors handed out: the file's share this node maps as its weights."""
        return sum(self.table.tensors[name].nbytes for name in self.handed_out)

    def resident_bytes(self) -> int:
        """Bytes of the mapping resident in this process now (`/proc/self/smaps`; 0 where unknown)."""
        return mapping_resident_bytes(self.path)

    def prefetch(self) -> None:
        """Ask the kernel to read the handed-out tensors' pages ahead (they are not made resident here)."""
        page = mmap.PAGESIZE
        for name in self.handed_out:
            entry = self.table.tensors[name]
            start = entry.offset // page * page
            try:
                self._map.madvise(mmap.MADV_WILLNEED, start, entry.offset + entry.nbytes - start)
            except (AttributeError, OSError, ValueError):  # (not on every platform)
                return

    def architecture(self) -> Architecture | None:
        """What the lean path needs, or None for an architecture it does not run."""
        return lean_architecture(self)


def mapping_resident_bytes(path: Path, smaps: str = "/proc/self/smaps") -> int:
    """The resident bytes of this process's mappings of `path`, summed from `smaps`; 0 where it cannot be read."""
    target, total, inside = str(path.resolve()), 0, False
    try:
        with open(smaps) as handle:
            for line in handle:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = line.rstrip("\n").endswith(" " + target)
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def lean_architecture(model: GgufModel) -> Architecture | None:
    """The lean path's facts from a GGUF's metadata, or None where it has none (an architecture it does not know, or
    a feature it lacks: those keep the transformers path)."""
    meta, kind = model.metadata, str(model.metadata.get("general.architecture", ""))
    if kind not in LEAN_ARCHITECTURES:
        return None

    def value(key: str, default: Any = None) -> Any:
        return meta.get(f"{kind}.{key}", default)

    scaling_type = value("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear") or value("attention.layer_norm_epsilon") is not None:
        return None  # (YaRN and other rope scalings, LayerNorm models: the transformers path)
    layers, hidden, heads, kv_heads = geometry(model.table)
    head_dim = int(value("attention.key_length", hidden // heads))
    if int(value("attention.value_length", head_dim)) != head_dim or not isinstance(value("feed_forward_length"), int):
        return None
    tokens = model.table.tensors.get("token_embd.weight")
    vocab = int(value("vocab_size", 0)) or (int(tokens.shape[0]) if tokens is not None else 0)
    rope_freqs = None
    if model.has("rope_freqs.weight"):
        rope_freqs = tuple(float(v) for v in model.vector("rope_freqs.weight").tolist())
        if len(rope_freqs) != head_dim // 2:
            return None
    gemma = kind == "gemma3"
    layer_types = tuple("full_attention" if not gemma or (index + 1) % GEMMA_GLOBAL_EVERY == 0 else
                        "sliding_attention" for index in range(layers))
    if gemma and int(value("attention.sliding_window", 0)) <= 0:
        return None
    factor = float(value("rope.scaling.factor", 1.0) or 1.0) if scaling_type == "linear" else 1.0
    return Architecture(
        kind=kind, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=int(value("feed_forward_length")), vocab=vocab, context=int(value("context_length", 2048)),
        eps=float(value("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(value("rope.freq_base", 10000.0)),
        rope_pairs=kind == "llama", rope_factor=factor, rope_freqs=rope_freqs,
        tied=not model.has("output.weight"), layer_types=layer_types,
        window=int(value("attention.sliding_window")) if gemma else None,
        local_theta=GEMMA_LOCAL_THETA if gemma else None, scaling=head_dim ** -0.5)
