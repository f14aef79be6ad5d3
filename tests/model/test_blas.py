"""`--matmul`: which library multiplies float32 weights, who gets the threads, and that OpenBLAS's products
are the same linear layers (the golden tests in `test_lean` run whole models both ways)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from meshws.model.kernels import blas
from meshws.model.kernels.cpu import cpu_vendor
from meshws.model.kernels.packed import linear, pack_linear

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2\n"
INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2\n"

needs_openblas = pytest.mark.skipif(blas.choose_matmul("openblas", "float32", False)[0] != "openblas",
                                    reason="numpy here does not multiply with OpenBLAS")


def test_auto_takes_openblas_for_float32_on_amd_and_says_why():
    assert cpu_vendor(AMD) == "AuthenticAMD" and cpu_vendor(INTEL) == "GenuineIntel"
    assert cpu_vendor("") == ""
    choice, reason = blas.choose_matmul("auto", "float32", False, vendor="AuthenticAMD", openblas=True)
    assert choice == "openblas" and "AMD" in reason
    for vendor in ("GenuineIntel", ""):  # MKL's own ground; and CPUs where OpenBLAS was not measured
        choice, reason = blas.choose_matmul("auto", "float32", False, vendor=vendor, openblas=True)
        assert choice == "torch" and "only on AMD" in reason
    assert blas.choose_matmul("openblas", "float32", False, vendor="GenuineIntel", openblas=True) == \
        ("openblas", "asked for")
    for dtype in ("bfloat16", "int8"):  # OpenBLAS has neither; int8 runs on FBGEMM
        choice, reason = blas.choose_matmul("openblas", dtype, False, vendor="AuthenticAMD", openblas=True)
        assert choice == "torch" and dtype in reason
    assert blas.choose_matmul("auto", "float32", True, vendor="AuthenticAMD", openblas=True)[0] == "torch"
    choice, reason = blas.choose_matmul("auto", "float32", False, vendor="AuthenticAMD", openblas=False)
    assert choice == "torch" and "OpenBLAS" in reason
    assert blas.choose_matmul("torch", "float32", False, vendor="AuthenticAMD", openblas=True) == \
        ("torch", "asked for")


@needs_openblas
def test_openblas_gets_the_threads_and_torch_keeps_one():
    before = blas.threads()
    try:
        blas.take_threads("openblas", "asked for", 2)
        assert (blas.multiplier(), blas.threads(), torch.get_num_threads()) == ("openblas", 2, 1)
        blas.set_threads(1)  # the host's core share changed (`cores`)
        assert (blas.threads(), torch.get_num_threads()) == (1, 1)
        blas.take_threads("torch", "asked for", None)  # a torch shard in the same process takes them back
        assert (blas.multiplier(), torch.get_num_threads()) == ("torch", 1)
        assert blas._find_openblas().get_num_threads() == 1, "OpenBLAS's idle threads must not spin beside torch's"
    finally:
        blas.use_torch(before)
    assert torch.get_num_threads() == before


@needs_openblas
def test_the_compute_thread_sets_what_the_loading_thread_set():
    """A node loads its shard on one thread and computes on another; the core share changes on the latter.
    (threadpoolctl's setter obeys only the first thread that used it: the share never reached OpenBLAS.)"""
    before = blas.threads()
    seen = []
    try:
        loader = threading.Thread(target=blas.take_threads, args=("openblas", "asked for", 2))
        loader.start()
        loader.join()
        assert blas.threads() == 2

        def compute():
            blas.set_threads(1)
            seen.append((blas.threads(), torch.get_num_threads()))

        worker = threading.Thread(target=compute)  # started while the loading thread could still be alive
        worker.start()
        worker.join()
        assert seen == [(1, 1)] and blas.threads() == 1, "the OpenBLAS count is the process's"
    finally:
        blas.use_torch(before)


@needs_openblas
@pytest.mark.parametrize("shape", [(96, 192), (192, 64), (7, 5)])
def test_openblas_products_are_the_linear_layer(shape):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=generator), torch.randn(shape[0], generator=generator)
    packed = pack_linear(weight, bias, torch.float32, None, openblas=True)
    assert packed.host.shape == (shape[1], shape[0]) and packed.host.flags["C_CONTIGUOUS"], "kept [in, out]"
    assert packed.weight.data_ptr() == packed.host.ctypes.data, "one copy: the tensor and the numpy view share it"
    rows = torch.randn(2, 3, shape[1], generator=generator)
    out = linear(rows, packed)
    assert out.shape == (2, 3, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(rows, weight, bias), rtol=1e-5, atol=1e-5)
    assert linear(rows[:0], packed).shape == (0, 3, shape[0])
    spoiled = rows.clone()
    spoiled[0, 1] = float("nan")
    out = linear(spoiled, packed)
    assert out[0, 1].isnan().all() and out[0, [0, 2]].isfinite().all() and out[1].isfinite().all()
    torch.testing.assert_close(out[1], F.linear(rows[1], weight, bias), rtol=1e-5, atol=1e-5)


@needs_openblas
def test_a_transposed_input_and_no_bias_work():
    weight = torch.randn(32, 16)
    packed = pack_linear(weight, None, torch.float32, None, openblas=True)
    rows = torch.randn(16, 8).t()  # not contiguous
    torch.testing.assert_close(linear(rows, packed), rows @ weight.t(), rtol=1e-5, atol=1e-5)
