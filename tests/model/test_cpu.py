"""`--dtype auto`: bf16 only where the CPU multiplies it natively, and the reason says so."""

from meshws.model.kernels.cpu import choose_dtype, cpu_flags

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_auto_picks_bf16_only_with_native_instructions():
    assert cpu_flags(AVX2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    dtype, reason = choose_dtype("auto", cpu_flags(AVX2))
    assert dtype == "float32" and "emulated" in reason
    dtype, reason = choose_dtype("auto", cpu_flags(SAPPHIRE))
    assert dtype == "bfloat16" and "amx_bf16" in reason and "avx512_bf16" in reason
    assert choose_dtype("auto", set()) == choose_dtype("auto", cpu_flags(""))  # unknown CPU: fp32


def test_a_named_dtype_is_kept():
    assert choose_dtype("bfloat16", cpu_flags(AVX2)) == ("bfloat16", "asked for")
    assert choose_dtype("float32", cpu_flags(SAPPHIRE)) == ("float32", "asked for")


def test_this_machine_gets_an_answer():
    dtype, reason = choose_dtype("auto")
    assert dtype in ("float32", "bfloat16") and reason
