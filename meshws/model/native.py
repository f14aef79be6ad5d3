"""meshws's own kernels (`kernels.c`), built on first use with this machine's C compiler.

int8 weights times float32 activations, the weights widened in registers: one token's
product reads a byte per weight and no more. On a 2-core AMD EPYC (AVX2) one row reads
11-12 GB/s on one thread, where FBGEMM's int8 GEMM, which must first quantize the row,
moved about 8 GB/s and loses precision on the activations.

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


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        self.avx2 = bool(library.mw_avx2())
        self._int8_linear = library.mw_int8_linear
        self._int8_linear.restype = ctypes.c_int
        self._int8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int]
        self.path = path

    def int8_linear(self, rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None, threads: int) -> torch.Tensor:
        """`rows @ (codes * scales[:, None]).T + bias`: rows float32 `[n, in]`, codes int8 `[out, in]`."""
        rows = rows.contiguous()
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != codes.shape[1]:
            raise ValueError(f"int8_linear takes float32 rows of width {codes.shape[1]}, not {tuple(rows.shape)}")
        out = torch.empty(rows.shape[0], codes.shape[0])
        if rows.shape[0]:
            self._int8_linear(rows.data_ptr(), rows.shape[0], rows.shape[1], codes.data_ptr(), scales.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), codes.shape[0], threads)
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
