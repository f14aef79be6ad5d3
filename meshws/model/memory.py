"""What this process holds in memory, what the machine has free, and a tensor set's bytes.

`default_cache_budget` sizes the KV cache byte budget a shard gets when none is set:
half of the memory available now (the smaller of the machine's and the cgroup's).

Resident memory counts weight pages mapped from the cache files once they are read
(they are shared with other processes mapping the same files), so it is measured after
a forward pass has touched them. Linux reports both figures in `/proc/self/status`;
elsewhere the peak comes from `getrusage` and the resident figure is unknown (0).
"""

from __future__ import annotations

import ctypes
import resource
import sys
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # (no torch at run time: the mesh reads a process's memory without it)
    import torch

STATUS = "/proc/self/status"
MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"  # cgroup v2: memory.max and memory.current
CACHE_SHARE = 0.5  # of the memory available at start, for KV caches when no budget is given
MIN_CACHE_BUDGET = 64 * 2**20


def process_memory() -> dict[str, int]:
    """{"resident_bytes": now, "peak_resident_bytes": the most since the process started}."""
    try:
        with open(STATUS) as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return {"resident_bytes": _kilobytes(fields["VmRSS"]), "peak_resident_bytes": _kilobytes(fields["VmHWM"])}
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"resident_bytes": 0, "peak_resident_bytes": peak if sys.platform == "darwin" else peak * 1024}


def _malloc_trim() -> Any:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # (the C library this process runs on)
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()
MAPPED_FROM = 256 * 1024  # allocations at least this large are pages of their own (`map_large_allocations`)


def map_large_allocations() -> None:
    """Allocations of `MAPPED_FROM` bytes or more get pages of their own, handed back when freed (glibc's
    M_MMAP_THRESHOLD, fixed). glibc raises the threshold by itself as large blocks are freed, after which a
    prefill's work buffers came from the heap and stayed resident among the KV blocks: 16 concurrent 1,500-token
    prompts grew a node by their KV and a third again."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(-3, MAPPED_FROM)  # M_MMAP_THRESHOLD


def give_back() -> None:
    """Hands the heap's free pages back to the system (glibc's `malloc_trim`: under 1 ms here). Caches of
    different sizes freed among one another leave pages free but resident: 16 new sessions' prompts prefilled in
    one call, 960 short sessions took a node from 338 to 400 MiB resident, all of it free (a trim: 326 MiB). Called
    as a shard's last session goes, so an idle node holds what it holds at rest."""
    if _TRIM is not None:
        _TRIM(0)


def available_memory(meminfo: str = MEMINFO, cgroup: str = CGROUP) -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by the cgroup's room; None if unknown."""
    found: list[int] = []
    try:
        with open(meminfo) as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        found.append(_kilobytes(fields["MemAvailable"]))
    except (OSError, KeyError, ValueError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as limit, open(f"{cgroup}/memory.current") as used:
            text = limit.read().strip()
            if text != "max":
                found.append(max(0, int(text) - int(used.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def default_cache_budget(available: int | None = None) -> int | None:
    """The KV cache byte budget when none is set: a share of the memory free now; None if unknown."""
    available = available_memory() if available is None else available
    if available is None:
        return None
    return max(MIN_CACHE_BUDGET, int(available * CACHE_SHARE))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors, a storage shared by several (tied weights) counted once."""
    sizes = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors}
    return sum(sizes.values())


def _kilobytes(value: str) -> int:
    number, unit = value.split()
    return int(number) * 1024 if unit == "kB" else int(number)
