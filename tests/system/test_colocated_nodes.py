"""Two nodes started by hand on one machine with default flags split its cores (README's way to start a mesh)."""

import asyncio
import time

import pytest

from helpers import CHAT_PROMPTS, chat_ids, complete_ids
from meshws.cores import usable_cores
from meshws.model.kernels.blas import choose_matmul
from meshws.model.kernels.cpu import choose_dtype
from meshws.model.kernels.native import kernels
from meshws.model.kernels.paths import direct_rows
from meshws.tools.launch import NodeProcess, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


async def test_hand_started_head_and_tail_share_the_cores_and_compute_one_wave_in_turn(tokenizer):
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
        fused = "decode fused (meshws kernel)" in compute["path"]  # (then decode runs on neither, prefill on torch)
        assert ("OpenBLAS products" in compute["path"]) == (matmul == "openblas" and not fused)
        assert compute["matmul"] == ("torch" if fused else matmul) and compute["matmul_reason"]
        # Sharing a host's cores, the head keeps its sessions in one wave, which each node computes on every core
        # in turn (`mesh.waves`): a burst of prompts may split it (the head's wait for the rest joins it again:
        # `test_compute`), or, its prompts prefilled in one call, start it whole.
        assert compute["waves"] == {"groups": 1, "whole": True} and tail.health()["compute"]["waves"]["groups"] == 1
        # Each node timed the two paths of a few rows on its own weights as it started, and runs what won there:
        # SmolLM2's layers are Q4_1, its LM head (the tail's) Q8_0.
        built = kernels()  # (the nodes' own build: none of these paths without AVX-512 VNNI)
        have = {built.block_types[type_id] for type_id in built.direct_types} if built else set()
        for node, names in ((head, {"Q4_1"}), (tail, {"Q4_1", "Q8_0"})):
            facts = node.health()["compute"]
            assert set(facts["paths"]) == names & have, facts["paths"]
            for name, measured in facts["paths"].items():
                timings = {int(count): (pair["direct"], pair["tiles"])
                           for count, pair in measured["microseconds"].items()}
                assert measured["direct_rows"] == direct_rows(timings) and min(min(timings.values())) > 0
                chosen = measured["direct_rows"]
                assert facts["products"][name].startswith(f"1-{chosen} rows: straight" if chosen else "tiles")
        ids = [chat_ids(tokenizer, CHAT_PROMPTS[index % 3]) for index in range(6)]
        alone = [await complete_ids(head.url, ids[index], 24, ignore_eos=True) for index in range(3)]
        started = time.monotonic()
        together = await asyncio.gather(*(complete_ids(head.url, one, 24, ignore_eos=True) for one in ids))
        assert list(together) == alone * 2
        for node in (head, tail):  # the prompts that queued behind the first were prefilled in one call
            assert node.health()["compute"]["work"]["prefill_batches"] >= 1
        steps = [rows for start, _, rows in head.health()["compute"]["recent_steps"] if start >= started]
        assert steps.count(6) >= 10, steps  # the whole wave's decode steps in one batch
        link = head.health()["links"][0]  # ... which crosses the hop as one frame, not six
        assert link["wave_frames"] >= 10 and link["wave_rows"] >= 5 * link["wave_frames"], link
    finally:
        for node in (head, tail):
            if node is not None:
                node.stop()
