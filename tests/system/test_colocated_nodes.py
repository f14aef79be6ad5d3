"""Two nodes started by hand on one machine with default flags split its cores (README's way to start a mesh)."""

import time

import pytest

from meshws.cores import usable_cores
from meshws.model.blas import choose_matmul
from meshws.model.cpu import choose_dtype
from meshws.tools.launch import NodeProcess, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


def test_hand_started_head_and_tail_share_the_cores():
    tail_port = free_port()
    tail = NodeProcess("--role", "tail", "--layers", "15-29", name="tail", port=tail_port)
    head = None
    try:
        tail.wait_started()
        alone = tail.health()["compute"]
        assert alone["threads"] == usable_cores() and "1 meshws node" in alone["threads_reason"]
        head = NodeProcess("--role", "head", "--layers", "0-14", "--peer", f"ws://127.0.0.1:{tail_port}", name="head")
        head.wait_started()
        head.wait_ready()
        share = max(1, usable_cores() // 2)
        assert head.health()["compute"]["threads"] == share
        deadline = time.monotonic() + 20  # the tail, started alone, notices the head within seconds
        while tail.health()["compute"]["threads"] != share and time.monotonic() < deadline:
            time.sleep(0.5)
        assert tail.health()["compute"]["threads"] == share
        matmul, _ = choose_matmul("auto", choose_dtype("auto")[0], compiled=False)  # what suits this CPU
        compute = head.health()["compute"]
        assert compute["path"].startswith("lean llama")
        assert ("OpenBLAS products" in compute["path"]) == (matmul == "openblas")
        assert compute["matmul"] == matmul and compute["matmul_reason"]
    finally:
        for node in (head, tail):
            if node is not None:
                node.stop()
