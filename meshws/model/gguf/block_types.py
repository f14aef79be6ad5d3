"""A GGUF tensor as the file stores it (`BlockTensor`), and which of ggml's block types a node computes on.

The table of block types lives once, in `quants.c` (`TYPES`, keyed by ggml's type id): which types the
kernels unpack, with their values and bytes per block. Here names and sizes come from the `gguf`
package (`GGML_QUANT_SIZES`), and `kernel_types` asks the built library which ids it has (checking
its sizes against gguf's); a test walks every row against `gguf.quants.dequantize`. Float tensors (F32, F16, BF16) need
no table: the kernels read them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # ggml ids of unquantized tensors
FLOAT_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
LARGEST_ID = 63  # ids asked of the library (ggml's go to 41 today)


def type_name(type_id: int) -> str:
    """ggml's name for a type id ("Q4_K"), or "type N" for one the gguf package does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def block_size(type_id: int) -> tuple[int, int]:
    """(values, bytes) of one block of `type_id`, as gguf defines it; ValueError for an unknown id."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown ggml type id {type_id}") from None


def supported_names(quantized: dict[int, str]) -> str:
    """The types a node computes on, for error messages: "F32, F16, BF16, Q4_0, ..."."""
    return ", ".join([*FLOAT_TYPES.values(), *quantized.values()])


@dataclass(frozen=True)
class BlockTensor:
    """A 2-d tensor as a GGUF holds it: `data` is uint8 `[rows, row_bytes]`, a view of the file's memory map.

    `shape` is (rows, columns) in torch order: a linear layer's (out, in), an embedding's (vocabulary, width).
    """

    name: str
    type_id: int
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def type_name(self) -> str:
        return FLOAT_TYPES.get(self.type_id) or type_name(self.type_id)

    @property
    def quantized(self) -> bool:
        return self.type_id not in FLOAT_TYPES

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def as_float(self) -> torch.Tensor:
        """An unquantized tensor's values as a torch tensor of its own dtype (a view: nothing copied)."""
        if self.quantized:
            raise TypeError(f"{self.name} is {self.type_name}: widen it (`Kernels.widen`)")
        return self.data.view(FLOAT_DTYPES[self.type_id]).view(self.shape)


def kernel_types(library: Any) -> dict[int, str]:
    """{ggml id: name} of the quantized types a built library computes on (`quants.c`'s table), each checked
    against gguf's sizes: a disagreement is a library of another source, refused (OSError)."""
    import ctypes

    found = {}
    for type_id in range(LARGEST_ID + 1):
        elements, size = ctypes.c_int64(), ctypes.c_int64()
        if library.mw_block_type(type_id, ctypes.byref(elements), ctypes.byref(size)):
            if (elements.value, size.value) != block_size(type_id):
                raise OSError(f"the kernels' table disagrees with gguf on {type_name(type_id)}")
            found[type_id] = type_name(type_id)
    return found
