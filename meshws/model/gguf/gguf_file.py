"""A GGUF file's tensor table, and one tensor at a time dequantised from its memory map.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array before
it lists a single tensor: 5 s and ~180 MB for SmolLM2's 49k-token vocabulary, 20 s and
~750 MB for Gemma-3's 262k. A shard that needs ten layers needs none of that, so this
module walks the header with `struct` (scalar metadata kept, arrays skipped) and
returns each tensor's type, shape and place in the file. The bytes stay in a read-only
memory map; `dequantize` turns one tensor into float32 a block of rows at a time with
the `gguf` package's own dequantisers, so the only large allocation is the result.
Name mapping and llama.cpp's value transforms are not here (see `gguf_convert`).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Iterable

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
HEAD_COUNTS = (".attention.head_count", ".attention.head_count_kv")
MAX_NESTING = 4  # arrays of arrays deeper than this are refused (a file could nest them until Python's stack ends)
# Metadata value types of fixed size: type id -> struct format.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
CHUNK_ELEMENTS = 4 * 1024 * 1024  # dequantised per step: 16 MB of float32 temporaries at most


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # in torch order (slowest dimension first)
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GgufTable:
    path: Path
    metadata: dict[str, Any]  # scalar and string values; arrays as their length, unless asked for whole
    tensors: dict[str, GgufTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def read_table(path: Path, arrays: Iterable[str] = ()) -> GgufTable:
    """Parse the header and tensor table of `path` without touching tensor data; the metadata arrays named in
    `arrays` (a vocabulary, merges) are read whole, as lists."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    wanted = set(arrays)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path} is not a GGUF file (too short)")
        blob = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if blob[:4] != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in VERSIONS:
            raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 (little-endian) are read")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(metadata_count):
            key, pos = _string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            whole = key in wanted or key.endswith(HEAD_COUNTS)  # (hybrid models give these per layer: a list)
            metadata[key], pos = _value(blob, pos + 4, value_type, whole)
        entries = []
        for _ in range(tensor_count):
            name, pos = _string(blob, pos)
            (dims,) = struct.unpack_from("<I", blob, pos)
            if dims > MAX_DIMS:  # (0: a scalar, as ggml reads it)
                raise ValueError(f"{path}: tensor {name} has {dims} dimensions (at most {MAX_DIMS} are read)")
            shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            entries.append((name, shape, ggml_type, offset))
    except struct.error:
        raise ValueError(f"{path} is truncated in its header") from None
    finally:
        blob.close()
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, not {alignment!r}")
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        try:
            block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has ggml type {ggml_type}, which gguf does not know") from None
        row = shape[-1] if shape else 1
        if row % block_elements:
            raise ValueError(f"{path}: tensor {name}'s rows of {row} values are not whole blocks of {block_elements}")
        nbytes = prod(shape) // block_elements * block_bytes
        tensors[name] = GgufTensor(name, shape, ggml_type, data_start + offset, nbytes)
    end = max((t.offset + t.nbytes for t in tensors.values()), default=data_start)
    if end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {end}, the file at {size}")
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} names no general.architecture")
    return GgufTable(Path(path), metadata, tensors)


def geometry(table: GgufTable) -> tuple[int, int, int, int]:
    """The architecture's layers, hidden size, attention heads and key-value heads, each checked to be a positive
    integer (and the heads a multiple of the key-value heads): ValueError naming the key, not a ZeroDivisionError
    later."""
    arch, meta = table.architecture, table.metadata
    heads = meta.get(f"{arch}.attention.head_count")  # (the key-value heads' default; a list is reduced below)
    values = {key: meta.get(f"{arch}.{key}", default) for key, default in (
        ("block_count", None), ("embedding_length", None), ("attention.head_count", None),
        ("attention.head_count_kv", heads))}
    for key, value in values.items():
        if isinstance(value, list):  # per layer: the largest (a layer without attention has 0)
            value = values[key] = max(value, default=None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{table.path.name}: {arch}.{key} must be a positive integer, not {value!r}")
    layers, hidden, heads, kv_heads = values.values()
    if heads % kv_heads:
        raise ValueError(f"{table.path.name}: {heads} attention heads cannot share {kv_heads} key-value heads")
    return layers, hidden, heads, kv_heads


def dequantize(table: GgufTable, name: str) -> np.ndarray:
    """One tensor as float32 in torch order, read from the file's memory map in row blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    info = table.tensors[name]
    kind = GGMLQuantizationType(info.ggml_type)
    blob = np.memmap(table.path, mode="r", dtype=np.uint8, offset=info.offset, shape=(info.nbytes,))
    if kind == GGMLQuantizationType.F32:
        return np.array(blob.view(np.float32).reshape(info.shape))  # a copy: the map is closed on return
    if kind == GGMLQuantizationType.F16:
        return blob.view(np.float16).reshape(info.shape).astype(np.float32)
    block_elements, block_bytes = GGML_QUANT_SIZES[kind]
    columns = info.shape[-1]
    rows = blob.reshape(-1, columns // block_elements * block_bytes)
    out = np.empty((rows.shape[0], columns), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // columns)
    for first in range(0, rows.shape[0], step):
        out[first : first + step] = gguf_dequantize(rows[first : first + step], kind)
    return out.reshape(info.shape)


def _string(blob: Any, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    start = pos + 8
    if start + length > len(blob):
        raise struct.error("a string runs past the end")
    return blob[start : start + length].decode("utf-8", errors="replace"), start + length


def _value(blob: Any, pos: int, value_type: int, whole: bool = False, depth: int = 0) -> tuple[Any, int]:
    if value_type in SCALARS:
        fmt = SCALARS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == STRING:
        return _string(blob, pos)
    if value_type == ARRAY:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element_type == ARRAY and depth >= MAX_NESTING:
            raise ValueError(f"GGUF metadata arrays nested deeper than {MAX_NESTING}")
        if element_type in SCALARS:
            width = struct.calcsize(SCALARS[element_type])
            if pos + count * width > len(blob):
                raise struct.error("an array runs past the end")
            if not whole:
                return count, pos + count * width
            return list(struct.unpack_from(f"<{count}{SCALARS[element_type][1]}", blob, pos)), pos + count * width
        values = []
        for _ in range(count):  # strings (a vocabulary) or nested arrays: walked, kept if asked for
            if element_type == STRING and not whole:
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
                continue
            value, pos = _value(blob, pos, element_type, whole, depth + 1)
            values.append(value)
        return (values if whole else count), pos
    raise ValueError(f"unknown GGUF metadata value type {value_type}")
