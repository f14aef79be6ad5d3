"""A session's keys and values on a shard: blocks of `KV_BLOCK` positions, shared between sessions where they agree.

A `KVBlock` holds `KV_BLOCK` positions of every layer of the shard, `[layers, 2, kv_heads, KV_BLOCK, dim]`
(each layer's keys, then its values), in the cache's dtype. A `LeanCache` is a list of blocks and the
positions it holds: it grows one block at a time (never copied, never more than a block of room
unused), and `copy` starts another session's cache on the same blocks (a fork, a shared prompt
prefix): a block is then held by both, counted once in a node's bytes, and copied only when one of
them writes into it (a position past where they agree). meshws's kernel reads the blocks where they
lie (`native.AttendRows`); the torch path reads a layer's positions gathered (`read`).

A node's bytes count a shared block once (`footprint`). `holders` counts the caches a block belongs to. It is raised by
`copy` and lowered by `release`, which the session store calls when it lets a cache go; a count left high (a cache never
released) costs a needless copy, never a wrong one, and a block's memory goes when no cache refers to it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy
import torch

from .cache_store import KVCacheMiss
from ..tensors import cache_nbytes

# Positions per block: a session holds fewer than this many positions of room it does not use. Attention reads a
# block's rows of one head as one run; runs of 64 positions made long decode steps a tenth slower than one buffer,
# runs of 256 cost a few percent (docs/performance.md).
KV_BLOCK = 256
_HOLDERS = threading.Lock()  # every change of a block's holders
KV_Q8_0 = "q8_0"  # a cache's dtype: ggml's Q8_0 blocks (32 values as int8, a float16 scale), as llama.cpp's q8_0 KV


def row_width(dtype: torch.dtype | str, head_dim: int) -> tuple[torch.dtype, int]:
    """How a cache of `dtype` stores a head's row of `head_dim` values: its tensors' dtype and the row's width."""
    if dtype == KV_Q8_0:
        if head_dim % 32:
            raise ValueError(f"q8_0 keys and values take heads of a multiple of 32 values, not {head_dim}")
        return torch.uint8, head_dim // 32 * 34
    return dtype, head_dim  # type: ignore[return-value]


class KVBlock:
    __slots__ = ("data", "holders")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [layers, 2, kv_heads, KV_BLOCK, dim]
        self.holders = 1


class LeanCache:
    """One session's keys and values for a shard's layers, in blocks; `length` is the positions held."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> None:
        self.layers = layers
        self.shape = (kv_heads, head_dim)
        self.dtype = dtype  # float32, bfloat16 or KV_Q8_0
        self.storage, self.width = row_width(dtype, head_dim)
        self.blocks: list[KVBlock] = []
        self.length = 0
        self.released = False
        self.changed_from = 0  # positions below it are as a standby was last sent them (`kv_copies`)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * KV_BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of this cache's blocks, shared ones included (`footprint` counts those once)."""
        return sum(block.data.nbytes for block in self.blocks)

    @property
    def shared_positions(self) -> int:
        """Positions from the start that lie in blocks another cache holds too."""
        count = 0
        for block in self.blocks:
            if block.holders < 2:
                break
            count += KV_BLOCK
        return min(count, self.length)

    def _new_block(self) -> KVBlock:
        return KVBlock(torch.empty(self.layers, 2, self.shape[0], KV_BLOCK, self.width, dtype=self.storage))

    def reserve(self, positions: int, start: int | None = None) -> None:
        """Room for `positions` positions, and the blocks a step writes (from `start`, this cache's length if not
        said) made this cache's own: a block shared with another is copied first. Every new block is made before
        any is swapped in, so a failed allocation leaves the cache as it was."""
        if self.released:  # (its blocks may look unshared to another session now: never written again)
            raise KVCacheMiss("the session's cache was let go")
        start = self.length if start is None else start
        first, last = start // KV_BLOCK, (positions - 1) // KV_BLOCK
        copies = {index: self._new_block() for index in range(first, min(last + 1, len(self.blocks)))
                  if self.blocks[index].holders > 1}
        added = [self._new_block() for _ in range(len(self.blocks), last + 1)]
        for index, block in copies.items():
            block.data.copy_(self.blocks[index].data)
            with _HOLDERS:
                self.blocks[index].holders -= 1
            self.blocks[index] = block
        self.blocks.extend(added)

    def crop_to(self, length: int) -> None:
        self.length = min(self.length, length)
        self.changed_from = min(self.changed_from, self.length)  # (what follows is written anew)

    def copy(self, length: int) -> "LeanCache":
        """Another session's cache holding this one's first `length` positions, on the same blocks."""
        copied = LeanCache(self.layers, *self.shape, self.dtype)
        with _HOLDERS:
            for block in self.blocks[: -(-length // KV_BLOCK)]:
                block.holders += 1
                copied.blocks.append(block)
        copied.length = min(length, self.length)
        return copied

    def release(self) -> None:
        """The session let this cache go: its blocks are no longer its (the memory goes with the last reference)."""
        with _HOLDERS:  # (the store may let a cache go on the event loop while the worker forks another)
            if not self.released:
                self.released = True
                for block in self.blocks:
                    block.holders -= 1

    # -- reading and writing one layer through torch -------------------------------

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values `[1, kv_heads, T, width]` as stored (`Kernels.to_q8_0`'s bytes for q8_0) at positions
        `start ..` of `layer` (room reserved)."""
        done, count = 0, keys.shape[2]
        while done < count:
            at = start + done
            block, offset = self.blocks[at // KV_BLOCK].data, at % KV_BLOCK
            n = min(KV_BLOCK - offset, count - done)
            block[layer, 0, :, offset : offset + n] = keys[0, :, done : done + n]
            block[layer, 1, :, offset : offset + n] = values[0, :, done : done + n]
            done += n

    def read(self, layer: int, end: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[1, kv_heads, end - start, dim]` of `layer` (gathered: a copy, unless in one block;
        q8_0 widened to float32 as gguf dequantizes it)."""
        parts = []
        at = start
        while at < end:
            offset = at % KV_BLOCK
            n = min(KV_BLOCK - offset, end - at)
            parts.append(self.blocks[at // KV_BLOCK].data[layer, :, :, offset : offset + n])
            at += n
        if not parts:
            kv_heads, dim = self.shape
            empty = torch.empty(1, kv_heads, 0, dim, dtype=torch.float32 if self.dtype == KV_Q8_0 else self.dtype)
            return empty, empty
        both = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [2, kv_heads, T, width]
        if self.dtype == KV_Q8_0:
            both = from_q8_0(both, self.shape[1])
        return both[0].unsqueeze(0), both[1].unsqueeze(0)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Positions `start .. end` of every layer as stored, `[layers, 2, kv_heads, end - start, width]` (a copy)."""
        parts, at = [], start
        while at < end:
            offset = at % KV_BLOCK
            n = min(KV_BLOCK - offset, end - at)
            parts.append(self.blocks[at // KV_BLOCK].data[:, :, :, offset : offset + n])
            at += n
        if not parts:
            return torch.empty(self.layers, 2, self.shape[0], 0, self.width, dtype=self.storage)
        return torch.cat(parts, dim=3)

    def put_rows(self, start: int, rows: torch.Tensor) -> None:
        """`rows` (as `rows` gives them) at positions `start ..`: what followed `start` is cut off first."""
        count = rows.shape[3]
        self.crop_to(start)
        self.reserve(start + count, start)
        done = 0
        while done < count:
            at = start + done
            offset, n = at % KV_BLOCK, min(KV_BLOCK - at % KV_BLOCK, count - done)
            self.blocks[at // KV_BLOCK].data[:, :, :, offset : offset + n] = rows[:, :, :, done : done + n]
            done += n
        self.length = start + count

    def pointers(self) -> list[int]:
        return [block.data.data_ptr() for block in self.blocks]


def from_q8_0(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Q8_0 rows `[..., dim / 32 * 34]` widened to float32 `[..., dim]` as gguf dequantizes them: each block's
    float16 scale times its int8 values (what meshws's kernel reads them as)."""
    shaped = blocks.reshape(*blocks.shape[:-1], dim // 32, 34)
    scales = shaped[..., :2].contiguous().view(torch.float16).float()
    return (scales * shaped[..., 2:].contiguous().view(torch.int8).float()).reshape(*blocks.shape[:-1], dim)


def block_table(caches: list[LeanCache]) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Every row's block addresses in turn, and where each row's start (`[rows + 1]`): the kernel's view of them."""
    pointers: list[int] = []
    first = [0]
    for cache in caches:
        pointers.extend(cache.pointers())
        first.append(len(pointers))
    return numpy.array(pointers, dtype=numpy.uint64), numpy.array(first, dtype=numpy.int64)


def footprint(caches: list[Any]) -> int:
    """Bytes the caches hold together: a block shared by several counted once (other caches: their `nbytes`)."""
    seen: set[int] = set()
    total = 0
    for cache in caches:
        blocks = getattr(cache, "blocks", None)
        if blocks is None:
            total += cache_nbytes(cache)
            continue
        for block in blocks:
            if id(block) not in seen:
                seen.add(id(block))
                total += block.data.nbytes
    return total
