"""meshws's own kernels (`kernels.c`), built on first use with this machine's C compiler.

int8 (or bfloat16) weights times float32 activations, the weights widened in registers:
one token's product reads each weight's bytes once and no more. On a 2-core AMD EPYC
(AVX-512) one row of int8 reads 13-15 GB/s per thread and 16-28 GB/s on both cores, where
FBGEMM's int8 GEMM, which must first quantize the row to 8 bits, moved about 8 GB/s and
lost precision on the activations. The kernel keeps its own helper threads (`kernels.c`);
the caller says how many threads it may use (the node's share of the cores).

The library is compiled once per source, compiler and CPU (`-O3 -march=native`) into
the cache folder (`$MESHWS_CACHE_DIR/native`, else `~/.cache/meshws/models/native`) and
loaded with ctypes; the compile takes about a second. With no C compiler, or if the
build fails, `kernels()` is None and int8 weights run on FBGEMM instead (the node says
which in `/health`). `MESHWS_NATIVE=0` forbids building it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .cpu import cpu_flags
from .source import default_cache_dir

log = logging.getLogger("meshws.shard")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-pthread"]


KINDS = {torch.int8: 0, torch.bfloat16: 1}  # the weight kinds of `mw_linear`


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        self.lanes = int(library.mw_lanes())
        self._linear = library.mw_linear
        self._linear.restype = None
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self.path = path

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
               bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        """`rows @ (weight * scales[:, None]).T + bias` in float32: rows float32 `[n, in]`, weight int8 (with
        `scales`) or bfloat16 `[out, in]`, contiguous."""
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != weight.shape[1]:
            raise ValueError(f"the kernel takes float32 rows of width {weight.shape[1]}, not {tuple(rows.shape)}")
        if weight.dtype not in KINDS or (scales is None) == (weight.dtype == torch.int8):
            raise ValueError("the kernel takes int8 weights with scales, or bfloat16 weights without")
        assert weight.is_contiguous() and (bias is None or bias.dtype == torch.float32)
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], weight.shape[0])
        if rows.shape[0]:
            self._linear(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(), KINDS[weight.dtype],
                         None if scales is None else scales.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), weight.shape[0], threads)
        return out


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)  # two nodes may build at once
    os.close(handle)
    try:
        subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


@functools.cache
def kernels() -> Kernels | None:
    """The kernels for this machine, built if need be; None where they cannot be."""
    if os.environ.get("MESHWS_NATIVE", "1") == "0":
        log.info("native kernels off (MESHWS_NATIVE=0)")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: int8 weights run on FBGEMM")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()
                             + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
        target = default_cache_dir() / "native" / f"kernels-{key}.so"
        if not target.is_file():
            _build(target, compiler)
            log.info("built the native kernels: %s", target)
        return Kernels(target)
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("the native kernels did not build (%s): int8 weights run on FBGEMM", str(detail).strip()[:500])
        return None
