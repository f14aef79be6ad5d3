"""What this process holds in memory: resident and peak resident bytes, and a tensor set's bytes.

Resident memory counts weight pages mapped from the cache files once they are read
(they are shared with other processes mapping the same files), so it is measured after
a forward pass has touched them. Linux reports both figures in `/proc/self/status`;
elsewhere the peak comes from `getrusage` and the resident figure is unknown (0).
"""

from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch

STATUS = "/proc/self/status"


def process_memory() -> dict[str, int]:
    """{"resident_bytes": now, "peak_resident_bytes": the most since the process started}."""
    try:
        with open(STATUS) as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return {"resident_bytes": _kilobytes(fields["VmRSS"]), "peak_resident_bytes": _kilobytes(fields["VmHWM"])}
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"resident_bytes": 0, "peak_resident_bytes": peak if sys.platform == "darwin" else peak * 1024}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors, a storage shared by several (tied weights) counted once."""
    sizes = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors}
    return sum(sizes.values())


def _kilobytes(value: str) -> int:
    number, unit = value.split()
    return int(number) * 1024 if unit == "kB" else int(number)
