"""A float32 shard whose weights come from a GGUF's Q4_1 or Q8_0 tensors reads them as their codes.

A Q4_1 tensor holds, for each 32 inputs of an output, a float16 scale `d`, a float16 minimum
`m` and 32 codes of 4 bits; `gguf` dequantises it as `d * code + m` in float32, and those
float32 values are the model a float32 node runs (a Q8_0 tensor: `d` and 32 signed bytes,
`d * code`). meshws's kernel (`KIND_Q4`, `KIND_Q8` in `kernels.c`) computes each value with the
same float32 operations from the codes as it reads them, so a product gets the float32
weights' bits exactly while reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4,
in blocks of 24 bytes (`d` and `m` as float32, then the codes) or 36 (`d`, the codes): a
float32 decode step, bound by the bytes it reads, needs a fifth of them.

`attach` gives the fused decode (`fused`) these blocks for every linear (and a tail's LM
head, tied to the embeddings or not) whose GGUF tensors are all such, in the model's row
order (transformers' processor permutes Llama's Q and K rows: the same permutation moves the
blocks), and keeps a linear's blocks only if they give its float32 weights bit for bit,
checked here once. Other paths (a prompt longer than one fused call takes, run op by op
through torch) keep the float32 weights, which the shard still holds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from .fused import FusedDecode

log = logging.getLogger("meshws.shard")

BLOCK = 32  # inputs a block covers
GGUF_BYTES = {3: 20, 8: 34}  # ggml's Q4_1 (float16 d and m, 16 bytes of codes) and Q8_0 (float16 d, 32 codes)
OUR_BYTES = {3: 24, 8: 36}  # meshws's blocks (`kernels.c` Q4_BYTES, Q8_BYTES): d (and m) as float32
CHECK_ROWS = 1024  # rows of a linear dequantised at once to check its blocks


def our_blocks(raw: np.ndarray, ggml_type: int, out: int, inputs: int) -> torch.Tensor:
    """A Q4_1 or Q8_0 tensor's bytes (`[out, inputs // 32 * 20 or 34]`) as meshws's blocks `[out, inputs // 32, 24
    or 36]`: each float16 converted to float32 (exactly), the codes as they are."""
    scales = 2 if ggml_type == 3 else 1
    blocks = np.ascontiguousarray(raw).reshape(out, inputs // BLOCK, GGUF_BYTES[ggml_type])
    ours = np.empty((out, inputs // BLOCK, OUR_BYTES[ggml_type]), np.uint8)
    ours[:, :, :4 * scales] = blocks[:, :, :2 * scales].copy().view(np.float16).astype(np.float32).view(np.uint8)
    ours[:, :, 4 * scales:] = blocks[:, :, 2 * scales:]
    return torch.from_numpy(ours)


def dequantized(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weights `[out, inputs]` the blocks hold, as `gguf` computes them: `d * code (+ m)`."""
    data = blocks.numpy()
    d = data[:, :, 0:4].copy().view(np.float32)
    if data.shape[2] == OUR_BYTES[8]:
        return torch.from_numpy((d * data[:, :, 4:].view(np.int8).astype(np.float32)).reshape(data.shape[0], -1))
    m, codes = data[:, :, 4:8].copy().view(np.float32), data[:, :, 8:]
    values = np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.float32)
    return torch.from_numpy((d * values + m).reshape(data.shape[0], -1))


class GgufBlocks:
    """The Q4_1 and Q8_0 tensors of a GGUF, as blocks in the model's names and row order."""

    def __init__(self, gguf: Any, folder: Any) -> None:
        from .gguf_convert import GgufTensors

        self.tensors = GgufTensors(gguf, folder)
        self.by_model = {model: name for name, model in self.tensors.to_model.items()}

    def blocks(self, model_name: str) -> torch.Tensor | None:
        name = self.by_model.get(model_name)
        entry = None if name is None else self.tensors.table.tensors.get(name)
        if entry is None or entry.ggml_type not in GGUF_BYTES or len(entry.shape) != 2 or entry.shape[1] % BLOCK \
                or entry.nbytes != entry.shape[0] * entry.shape[1] // BLOCK * GGUF_BYTES[entry.ggml_type]:
            return None  # (a table whose sizes disagree: the float32 weights, converted or refused elsewhere)
        out, inputs = entry.shape
        raw = np.memmap(self.tensors.table.path, np.uint8, "r", entry.offset, entry.nbytes)
        rows = np.arange(out, dtype=np.float64).reshape(out, 1)  # the processor's row order, by moving indices
        moved = self.tensors.processor.process(weights=rows, name=name, tensor_key_mapping=self.tensors.to_model,
                                               parsed_parameters={"tensors": {}}).weights
        order = np.asarray(moved).reshape(out).astype(np.int64)
        return our_blocks(np.asarray(raw).reshape(out, -1)[order], entry.ggml_type, out, inputs)


LINEAR_NAMES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # `lean._Layer.linears`, in order


def _checked(packed: Any, parts: list[torch.Tensor | None], what: str) -> Any:
    """`packed` with the blocks `parts` (stacked) where they give its float32 weight bit for bit, else as it is."""
    if not parts or any(part is None for part in parts) or packed is None or packed.weight is None \
            or packed.weight.dtype != torch.float32 or packed.codes is not None \
            or len({part.shape[2] for part in parts}) != 1:
        return packed
    blocks, weight = torch.cat(parts), packed.weight
    if any(not torch.equal(dequantized(blocks[at:at + CHECK_ROWS]).view(torch.int32),
                           weight[at:at + CHECK_ROWS].contiguous().view(torch.int32))
           for at in range(0, blocks.shape[0], CHECK_ROWS)):  # (a few rows at a time: a large model's too)
        log.warning("%s: the GGUF's blocks do not give its float32 weights; it stays float32", what)
        return packed
    return packed._replace(blocks=blocks)


def attach(lean: Any, source: Any, first_layer: int, tied: bool = False) -> int:
    """Give `lean`'s float32 linears (layer i of `lean` is the model's layer `first_layer + i`) and its LM head
    (the embeddings' tensor where `tied`) their blocks (`Linear.blocks`) where those hold their weights bit for
    bit. Returns how many linears got blocks."""
    count = 0
    for index, layer in enumerate(lean.layers):
        prefix = f"model.layers.{first_layer + index}"
        found = [_checked(packed, [source.blocks(f"{prefix}.{name}.weight") for name in names],
                          f"{prefix}.{'+'.join(names)}") for packed, names in zip(layer.linears(), LINEAR_NAMES)]
        count += sum(packed.blocks is not None for packed in found)
        layer.qkv, layer.o, layer.gate_up, layer.down = found
    if lean.lm_head is not None:
        head = source.blocks("model.embed_tokens.weight" if tied else "lm_head.weight")
        lean.lm_head = _checked(lean.lm_head, [head], "the LM head")
        count += lean.lm_head.blocks is not None
    return count


def with_gguf_blocks(lean: Any, resolved: Any, first_layer: int, tied: bool) -> Any:
    """`lean` (a shard's `LeanLayers`, or None), its float32 fused decode reading the GGUF's blocks where they
    hold its weights (`MESHWS_BLOCKS=0`: never)."""
    if lean is None or lean.fused is None or lean.dtype != torch.float32 or lean.quant or resolved.gguf is None \
            or os.environ.get("MESHWS_BLOCKS", "1") == "0":
        return lean
    if attach(lean, GgufBlocks(resolved.gguf, resolved.folder), first_layer, tied):
        lean.fused = FusedDecode(lean, lean.kernels)  # the structures again, pointing at the blocks
    return lean
