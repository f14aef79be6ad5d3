"""What this CPU does well: the compute dtype `--dtype auto` picks, and why; its flags and vendor.

bf16 pays only where the CPU multiplies bf16 natively (AVX-512-BF16 or AMX); elsewhere
torch emulates it, and batched bf16 matmuls run several times slower than fp32 (on an
AVX2 machine, 16 rows through a 576x1536 linear: ~2.0 ms bf16 against ~0.5 ms fp32).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: str | None) -> str:
    """The first `/proc/cpuinfo` field (Linux) named one of `names`, or "" where unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.startswith(names):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of this machine's CPU; empty where unknown."""
    return set(_cpuinfo_field(("flags", "Features"), cpuinfo).split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """"AuthenticAMD", "GenuineIntel", ...; "" where unknown (`blas.choose_matmul`)."""
    return _cpuinfo_field(("vendor_id",), cpuinfo)


def choose_dtype(requested: str, flags: set[str] | None = None) -> tuple[str, str]:
    """The compute dtype for `requested` ("auto", "float32" or "bfloat16"), and the reason, for the log."""
    if requested != "auto":
        return requested, "asked for"
    flags = cpu_flags() if flags is None else flags
    native = sorted(flag for flag in NATIVE_BF16_FLAGS if flag in flags)
    if native:
        return "bfloat16", f"the CPU multiplies bf16 natively ({', '.join(native)})"
    return "float32", "the CPU has no native bf16 (no avx512_bf16 or amx_bf16): bf16 would be emulated"
