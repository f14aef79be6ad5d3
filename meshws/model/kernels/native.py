"""meshws's own kernels (`kernels.c`), built on first use with this machine's C compiler.

* `Kernels.linear`: int8 weights (one scale per output channel), bfloat16 or float32
  weights times float32 rows, the weights widened in registers, so one token's product
  reads each weight's bytes once and no more. On a 2-core AMD EPYC (AVX-512) one row of
  int8 reads 13-15 GB/s per thread and 16-28 GB/s on both cores, where FBGEMM's int8
  GEMM, which must first quantize the row to 8 bits, moved about 8 GB/s and lost
  precision on the activations.
* `mw_decode` (through `fused.FusedDecode`): a Llama-style shard's whole decode step,
  every layer and row, in one call.
* `Kernels.qlinear`, `Kernels.widen` and `Kernels.linear` on a `BlockTensor`: a GGUF's
  blocks as stored (`quants.c`): 8-bit activations times the codes, rows widened exactly
  as gguf dequantizes them (embeddings on lookup), or float32 products on the exact values.
* `Kernels.attend`: a decode step's attention for a batch of sessions, each row against
  its own cache of its own length, in one call per layer (torch's bf16 sdpa took 20 us per
  call at 32 positions and 450 us at 1024 here; this takes 25 and 100, for every row).

A row's result never depends on the rows batched with it or on the thread count. The
kernels keep their own helper threads; the caller says how many may compute (the node's
share of the cores).

The library is built once per source, compiler and CPU (`kernel_build`), started in the
background as a node starts. With no C compiler, or if the build fails, `kernels()` is None:
int8 weights run on FBGEMM, decode attention on torch's sdpa, a GGUF on the transformers path
(`/health` says which). `MESHWS_NATIVE=0` forbids building it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy
import torch

from . import kernel_build
from ..gguf.block_types import BlockTensor, kernel_types, supported_names
from ..kv.kv_blocks import KV_BLOCK, KV_Q8_0, block_table

log = logging.getLogger("meshws.shard")

SOURCE, FLAGS = kernel_build.SOURCE, kernel_build.FLAGS


_lent: int | None = None  # threads the kernels may use now (`cores.CoreShare` lends them step by step)


def lend_threads(count: int | None) -> None:
    """(The compute thread, before a step.) How many threads meshws's kernels may use; None: torch's count."""
    global _lent
    _lent = count


def threads() -> int:
    """Threads for a kernel call now: those lent, else torch's (the node's share of the cores)."""
    return _lent or torch.get_num_threads()


# Weights `mw_linear` takes, by dtype, as the kernels number them (ggml's type ids; int8 with scales is meshws's own);
# caches are float32 or bfloat16. A GGUF's block tensors go by their own type ids (`block_types`).
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30, torch.int8: 100}
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 30, KV_Q8_0: 8}  # keys and values (Q8_0: ggml's id)
PATHS = {"chosen": 0, "tiles": 1, "direct": 2}  # a 32-value block type's product paths (`quants.c`'s PATH_*)


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        self._linear = library.mw_linear
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int]
        self._qlinear = library.mw_qlinear_on
        self._qlinear.restype = ctypes.c_int
        self._qlinear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                  ctypes.c_int]
        self._widen = library.mw_widen
        self._widen.restype = ctypes.c_int
        self._widen.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.block_types = kernel_types(library)  # {ggml id: name} of the quantized types it computes on
        library.mw_direct_rows.restype, library.mw_direct_rows.argtypes = ctypes.c_int, [ctypes.c_int]
        self._set_direct_rows = library.mw_set_direct_rows
        self._set_direct_rows.restype, self._set_direct_rows.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        # rows of a 32-value type's product that run straight from the blocks (more: on tiles); 0: tiles always.
        # Defaults measured on a Zen 4; a node measures its own (`paths.choose_paths`).
        self.direct_rows = {type_id: library.mw_direct_rows(type_id) for type_id in self.block_types}
        self.direct_types = frozenset(type_id for type_id, rows in self.direct_rows.items() if rows)  # have the path
        self.measured_paths: dict[str, Any] = {}  # what `paths.choose_paths` measured, by type name (/health)
        self.decode = library.mw_decode  # called by `fused.FusedDecode`, which checks what it hands over
        self.decode.restype = ctypes.c_int
        self.decode.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_float] * 2 \
            + [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
        self._amx_linear = library.mw_amx_linear
        self._amx_linear.restype = ctypes.c_int
        self._amx_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        library.mw_amx.restype = ctypes.c_int
        # AMX tiles for bf16 products: the CPU has them (the build saw __AMX_BF16__) and Linux lets us use them.
        self.amx = os.environ.get("MESHWS_AMX", "1") != "0" and library.mw_amx() == 1
        self._to_q8_0 = library.mw_to_q8_0
        self._to_q8_0.restype, self._to_q8_0.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._turn = library.mw_turn
        self._turn.restype, self._turn.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._attend = library.mw_attend
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 \
            + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: "AttendRows", layer: int,
               threads: int) -> torch.Tensor:
        """One decode step's attention in `layer` for rows of different sessions (`caches`): row r's new key
        and value (`k`, `v` `[rows, kv_heads, 1, width]`, as the caches store them) are written at its position
        in its own cache, and its query (`q` `[rows, heads, 1, dim]`) attends to its positions there."""
        rows, heads, _, dim = q.shape
        width = caches.caches[0].width
        if rows != len(caches.caches) or dim != caches.dim or heads % caches.kv_heads \
                or k.dtype != caches.caches[0].storage or not k.shape == v.shape == (rows, caches.kv_heads, 1, width):
            raise ValueError(f"keys {tuple(k.shape)} {k.dtype} do not fit {len(caches.caches)} caches of "
                             f"{caches.kv_heads} heads of {caches.dim} {caches.dtype}")
        query = q.detach().reshape(rows, heads, dim).float().contiguous()
        new_keys = k.detach().reshape(rows, caches.kv_heads, width).contiguous()
        new_values = v.detach().reshape(rows, caches.kv_heads, width).to(k.dtype).contiguous()
        out = torch.empty(rows, heads, dim)
        failed = self._attend(rows, heads, caches.kv_heads, dim, query.data_ptr(), new_keys.data_ptr(),
                              new_values.data_ptr(), caches.blocks.ctypes.data, caches.first.ctypes.data, KV_BLOCK,
                              layer, caches.low_at.ctypes.data,
                              caches.low_at.ctypes.data + 8 * rows, CACHE_KINDS[caches.dtype], caches.scale,
                              out.data_ptr(), threads)
        if failed:
            raise MemoryError("no memory for a decode step's attention scores")
        return out.view(rows, heads, 1, dim).to(q.dtype)

    def turn(self, values: torch.Tensor) -> torch.Tensor:
        """Heads `[..., dim]` turned by the Walsh-Hadamard matrix of dim's largest power-of-two part, in float32
        (as q8_0 caches keep keys and values, and `mw_decode` turns them: the same bits)."""
        out = values.detach().float().contiguous()
        out = out.clone() if out.data_ptr() == values.data_ptr() else out  # (turned in place: never the caller's)
        self._turn(out.data_ptr(), out.numel() // out.shape[-1], out.shape[-1])
        return out

    def to_q8_0(self, values: torch.Tensor) -> torch.Tensor:
        """Values `[..., dim]` (dim a multiple of 32) as ggml's Q8_0 blocks, `[..., dim / 32 * 34]` bytes."""
        if values.shape[-1] % 32:
            raise ValueError(f"q8_0 takes rows of a multiple of 32 values, not {values.shape[-1]}")
        flat = values.detach().float().contiguous()
        out = torch.empty(*values.shape[:-1], values.shape[-1] // 32 * 34, dtype=torch.uint8)
        if self._to_q8_0(flat.data_ptr(), flat.numel(), out.data_ptr()):
            raise ValueError(f"q8_0 takes rows of a multiple of 32 values, not {values.shape[-1]}")
        return out

    def amx_tiles(self, weight: torch.Tensor) -> torch.Tensor | None:
        """bfloat16 weights `[out, in]` repacked for `amx_linear` (1 KiB tiles of 16 outputs x 32 inputs, input
        pairs side by side; per 64 outputs, their four tiles of each 32 inputs in turn), or None where AMX is off or
        the shape does not tile (out % 64, in % 32). `[groups, chunks, 4, 16, 16, 2]`."""
        out_features, inputs = weight.shape
        if not self.amx or weight.dtype != torch.bfloat16 or out_features % 64 or inputs % 32:
            return None
        return weight.detach().reshape(out_features // 64, 4, 16, inputs // 32, 16, 2).permute(
            0, 3, 1, 4, 2, 5).contiguous()

    def amx_linear(self, rows: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None,
                   threads: int) -> torch.Tensor:
        """`rows @ weight.T + bias` in float32 on AMX: rows float32 `[n, in]` holding bf16 values, `tiles` from
        `amx_tiles(weight)`."""
        groups, chunks = tiles.shape[0], tiles.shape[1]
        if tiles.shape[2:] != (4, 16, 16, 2) or rows.dtype != torch.float32 or rows.dim() != 2 \
                or rows.shape[1] != chunks * 32 or (bias is not None and bias.shape != (groups * 64,)):
            raise ValueError(f"rows {tuple(rows.shape)} do not fit tiles {tuple(tiles.shape)}")
        rows = rows.contiguous()
        bias = None if bias is None else bias.float().contiguous()
        out = torch.empty(rows.shape[0], groups * 64)
        if rows.shape[0] and self._amx_linear(rows.data_ptr(), rows.shape[0], rows.shape[1], tiles.data_ptr(),
                                              None if bias is None else bias.data_ptr(), out.data_ptr(),
                                              groups * 64, threads):
            raise MemoryError("no memory for an AMX product")
        return out

    def product_paths(self, type_ids: Iterable[int]) -> dict[str, str]:
        """/health: how a batch's 8-bit products run, per block type. The paths give the same bits; which one runs
        depends only on how many rows come together."""
        paths = {}
        for type_id in sorted(set(type_ids)):
            rows, name = self.direct_rows.get(type_id, 0), self.block_types.get(type_id, str(type_id))
            tiles = "tiles of 16 outputs, laid out once for all the rows"
            paths[name] = ("each weight row against 8 rows at a time" if name.endswith("_K") else
                           f"1-{rows} rows: straight from the blocks; more: {tiles}" if rows else tiles)
        return paths

    def linear(self, rows: torch.Tensor, weight: torch.Tensor | BlockTensor, scales: torch.Tensor | None,
               bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        """`rows @ (weight * scales[:, None]).T + bias` in float32: rows float32 `[n, in]`, weight `[out, in]`,
        contiguous, int8 with one float32 scale per output, or float32, float16 or bfloat16 without; or a GGUF's
        block tensor, its values widened exactly as gguf dequantizes them."""
        blocks = isinstance(weight, BlockTensor)
        width = weight.shape[1]
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != width:
            raise ValueError(f"the kernel takes float32 rows of width {width}, not {tuple(rows.shape)}")
        if blocks:
            kind, data = self._block_kind(weight), weight.data
            if scales is not None:
                raise ValueError("block weights carry their own scales")
        else:
            kind, data = KINDS.get(weight.dtype), weight
            if kind is None or (weight.dtype == torch.int8) != (scales is not None):
                raise ValueError("the kernel takes int8 weights with scales, or float weights without")
        out_features = weight.shape[0]
        if not data.is_contiguous() or any(t is not None and (t.dtype != torch.float32 or t.shape != (out_features,)
                                                              or not t.is_contiguous()) for t in (scales, bias)):
            raise ValueError("the kernel takes contiguous weights, and float32 scales and bias of one per output")
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features)
        if rows.shape[0]:
            if self._linear(rows.data_ptr(), rows.shape[0], rows.shape[1], data.data_ptr(), kind,
                            None if scales is None else scales.data_ptr(), None if bias is None else bias.data_ptr(),
                            out.data_ptr(), out_features, out_features, threads):
                raise MemoryError("no memory to widen a product's weights into")
        return out

    def set_direct_rows(self, type_id: int, rows: int) -> int:
        """How many rows of a 32-value type's product run straight from the blocks (more: on tiles); returns what
        holds now (0 where the build or type has tiles only). Both paths give the same bits."""
        self.direct_rows[type_id] = self._set_direct_rows(type_id, rows)
        return self.direct_rows[type_id]

    def qlinear(self, rows: torch.Tensor, weight: BlockTensor, bias: torch.Tensor | None, threads: int,
                path: str = "chosen") -> torch.Tensor:
        """`rows @ weight.T + bias` with each row quantized to 8 bits per 32 values and integer dot products with
        the blocks (`quants.c`, as llama.cpp multiplies): float32 rows `[n, in]`, float32 out. (A float tensor
        multiplies as it is: `linear`.) `path` "tiles" or "direct" forces a 32-value type's path (to measure it;
        "direct" where there is none runs tiles); "chosen": what `direct_rows` says for this many rows."""
        if not weight.quantized:
            return self.linear(rows, weight, None, bias, threads)
        kind = self._block_kind(weight)
        out_features, width = weight.shape
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != width:
            raise ValueError(f"the kernel takes float32 rows of width {width}, not {tuple(rows.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)
                                 or not bias.is_contiguous()):
            raise ValueError("the kernel takes a float32 bias of one per output")
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features)
        if rows.shape[0]:
            failed = self._qlinear(rows.data_ptr(), rows.shape[0], width, weight.data.data_ptr(), kind,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                   out_features, threads, PATHS[path])
            if failed:
                raise MemoryError("no memory for a product's quantized rows")
        return out

    def widen(self, weight: BlockTensor, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
              threads: int = 1) -> torch.Tensor:
        """Rows of a block tensor (`ids`, int64; all without) as float32 values exactly as gguf dequantizes them,
        or those rounded to bfloat16 (to nearest even): `[rows, columns]`."""
        kind = self._block_kind(weight)
        if not weight.quantized:  # a float tensor: its rows as they are
            values = weight.as_float()
            return (values if ids is None else values[ids.to(torch.int64)]).to(dtype)
        rows = weight.shape[0] if ids is None else ids.numel()
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            if rows and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
                raise ValueError(f"row ids must lie in [0, {weight.shape[0]})")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("blocks widen to float32 or bfloat16")
        out = torch.empty(rows, weight.shape[1], dtype=dtype)
        if rows and self._widen(kind, weight.data.data_ptr(), weight.shape[1], None if ids is None else ids.data_ptr(),
                                rows, out.data_ptr() if dtype == torch.float32 else None,
                                out.data_ptr() if dtype == torch.bfloat16 else None, threads):
            raise ValueError(f"{weight.name}: the kernels cannot widen {weight.type_name} rows of "
                             f"{weight.shape[1]} values")
        return out

    def _block_kind(self, weight: BlockTensor) -> int:
        if weight.quantized and weight.type_id not in self.block_types:
            raise ValueError(f"{weight.name} is {weight.type_name}; the kernels compute on "
                             f"{supported_names(self.block_types)}")
        if not weight.data.is_contiguous() or weight.data.dtype != torch.uint8:
            raise ValueError(f"{weight.name}: block data must be contiguous bytes")
        return weight.type_id


@functools.cache
def kernels() -> Kernels | None:
    """The kernels for this machine, built if need be (`kernel_build`); None where they cannot be."""
    if os.environ.get("MESHWS_NATIVE", "1") == "0":
        log.info("native kernels off (MESHWS_NATIVE=0)")
        return None
    try:
        for attempt in (1, 2):  # a library that does not load (cut short, another libc) is built again, once
            target = kernel_build.library(rebuild=attempt == 2)
            if target is None:
                log.info("no C compiler: int8 weights run on FBGEMM, decode attention on torch's sdpa")
                return None
            try:
                return Kernels(target)
            except OSError:
                if attempt == 2:
                    raise
        return None
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("the native kernels are not used (%s): int8 weights run on FBGEMM, decode attention on "
                    "torch's sdpa", str(detail).strip()[:500])
        return None


class AttendRows:
    """A decode step's rows for `Kernels.attend`, checked once for all layers: row r is at position
    `at[r]` of its cache `caches[r]` (a `kv_blocks.LeanCache`) and attends from `low[r]`. The caches must
    have room for `at`, in a block of their own (the kernel writes there), and hold keys of one dtype and shape."""

    def __init__(self, caches: Sequence[Any], low: Sequence[int], at: Sequence[int], scale: float) -> None:
        first = caches[0]
        self.caches, self.scale = caches, scale
        self.dtype, (self.kv_heads, self.dim) = first.dtype, first.shape
        capacity = numpy.array([cache.capacity for cache in caches], dtype=numpy.int64)
        self.low_at = numpy.array([list(low), list(at)], dtype=numpy.int64).reshape(2, len(caches))
        if len({(id(cache), int(row)) for cache, row in zip(caches, self.low_at[1])}) != len(caches):
            raise ValueError("a position of a session's cache appears twice in one step")  # (rows of one session
            # at consecutive positions are a multi-token step: each sees the keys of the rows before it)
        if self.dtype not in CACHE_KINDS or any(
                cache.dtype != self.dtype or cache.shape != first.shape for cache in caches):
            raise ValueError("attention takes caches of one shape, in float32, bfloat16 or q8_0")
        if not ((0 <= self.low_at[0]) & (self.low_at[0] <= self.low_at[1]) & (self.low_at[1] < capacity)).all():
            raise ValueError("each row attends within its cache: 0 <= low <= at < capacity")
        if any(cache.blocks[int(row) // KV_BLOCK].holders != 1 for cache, row in zip(caches, self.low_at[1])):
            raise ValueError("a step writes into a block another session holds too")
        self.blocks, self.first = block_table(list(caches))

    @classmethod
    def per_type(cls, caches: Sequence[Any], pasts: Sequence[int], layer_types: Sequence[str], window: int | None,
                 scale: float) -> dict[str, "AttendRows"]:
        """Per layer type, rows at `pasts` attending to all they hold, or (sliding attention) the last `window`."""
        found = {}
        for layer_type in set(layer_types):
            span = window if layer_type == "sliding_attention" else None
            found[layer_type] = cls(caches, [max(0, past + 1 - span) if span else 0 for past in pasts], pasts, scale)
        return found
