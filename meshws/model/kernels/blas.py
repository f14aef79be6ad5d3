"""Which library multiplies a float32 shard's weights, and who gets the threads.

torch's x86 builds multiply with MKL. On an AMD EPYC (AVX2, 2 cores) MKL 2024.2 reads a
decode step's weights at 9-12 GB/s, while the OpenBLAS that numpy ships reads the same
weights, stored `[in, out]`, at 18-21 GB/s and multiplies 16 rows 1.2-2x faster (one
thread or two; `python -m meshws.bench` compares the two in its decode-step table). So
`--matmul auto` runs float32 products on OpenBLAS on AMD CPUs (the one kind measured; on
Intel's MKL is on its own ground); `torch` and `openblas` choose by hand.

Each library keeps a pool of threads that spin for a while when idle. Give both pools
every core and each steals the other's: a full node fell from 26 to 4 tok/s. So while
OpenBLAS multiplies, it gets the process's threads and torch keeps one (norms,
attention, sampling: small); otherwise torch has them. The pools are the process's, so
this state is too: `use_openblas`, `use_torch`, `set_threads`.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging

import numpy
import torch

from .cpu import cpu_vendor

log = logging.getLogger("meshws.shard")


class OpenBLAS:
    """numpy's OpenBLAS library, its process-wide thread count set from whichever thread computes.

    (threadpoolctl finds the library; its own setter only obeys the first thread that used it,
    here the loading thread, and silently ignores the compute thread.)
    """

    def __init__(self, path: str) -> None:
        library = ctypes.CDLL(path)
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):  # as numpy's wheels name them
            if hasattr(library, f"{prefix}openblas_get_num_threads{suffix}"):
                self._get = getattr(library, f"{prefix}openblas_get_num_threads{suffix}")
                self._set = getattr(library, f"{prefix}openblas_set_num_threads{suffix}")
                return
        raise OSError(f"{path} has no openblas_set_num_threads")

    def get_num_threads(self) -> int:
        return int(self._get())

    def set_num_threads(self, threads: int) -> None:
        self._set(ctypes.c_int(threads))


_openblas: OpenBLAS | None = None  # numpy's OpenBLAS while the products run there


@functools.cache  # the libraries a process has loaded do not change: looked up once, not per shard
def _find_openblas() -> OpenBLAS | None:
    """numpy's OpenBLAS, or None when numpy multiplies with something else (or threadpoolctl is missing)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    numpy.ones(1) @ numpy.ones(1)  # numpy's BLAS is loaded by now; threadpoolctl finds loaded libraries
    found = [lib["filepath"] for lib in threadpool_info()
             if lib.get("internal_api") == "openblas" and lib.get("threading_layer") == "pthreads"]
    for path in sorted(found, key=lambda path: "numpy" not in path):  # numpy's own first (scipy may bring one)
        try:
            return OpenBLAS(path)
        except (OSError, AttributeError):
            continue
    return None


def choose_matmul(requested: str, dtype: str, compiled: bool, vendor: str | None = None,
                  openblas: bool | None = None) -> tuple[str, str]:
    """"openblas" or "torch" for a lean shard asked for `requested` (auto, torch, openblas), and why."""
    if requested == "torch":
        return "torch", "asked for"
    if dtype != "float32":
        return "torch", f"OpenBLAS has no {dtype} products"
    if compiled:
        return "torch", "compiled graphs call torch's own products"
    if not (_find_openblas() is not None if openblas is None else openblas):
        return "torch", "numpy here does not multiply with a pthreads OpenBLAS (or threadpoolctl is missing)"
    if requested == "openblas":
        return "openblas", "asked for"
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == "AuthenticAMD":
        return "openblas", "an AMD CPU: MKL reads weights at about half OpenBLAS's speed here"
    return "torch", f"OpenBLAS was measured faster only on AMD CPUs ({vendor or 'vendor unknown'} here)"


def use_openblas(threads: int) -> None:
    """Products on OpenBLAS with `threads` threads; torch keeps one."""
    global _openblas
    _openblas = _openblas or _find_openblas()
    if _openblas is None:
        raise RuntimeError("numpy here does not multiply with OpenBLAS")
    torch.set_num_threads(1)
    _openblas.set_num_threads(max(1, threads))


def use_torch(threads: int) -> None:
    """Products on torch with `threads` threads (OpenBLAS, if it was in use, drops to one: it must not spin)."""
    global _openblas
    if _openblas is not None:
        _openblas.set_num_threads(1)
        _openblas = None
    torch.set_num_threads(max(1, threads))


def take_threads(matmul: str, reason: str, count: int | None) -> None:
    """A shard starts: the process's threads (`count`, or as many as now) go to the library it multiplies with."""
    log.info("float products on %s: %s", matmul, reason)
    count = count or threads()  # as many as the process computes with now
    if matmul == "openblas":
        use_openblas(count)
    else:  # (OpenBLAS, if another shard in this process had the threads, drops to one)
        use_torch(count)


def set_threads(threads: int) -> None:
    """The compute's thread count, given to whichever library multiplies; called on the thread that computes
    (torch keeps the count per thread: one set on a loading thread does not reach the compute thread).
    Cheap when nothing changes: the compute worker calls it between jobs."""
    threads = max(1, threads)
    if _openblas is not None:
        if _openblas.get_num_threads() != threads:
            _openblas.set_num_threads(threads)
        threads = 1
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def threads() -> int:
    """The threads the process computes with: OpenBLAS's while it multiplies, else torch's (this thread's)."""
    return _openblas.get_num_threads() if _openblas is not None else torch.get_num_threads()


def multiplier() -> str:
    return "openblas" if _openblas is not None else "torch"
