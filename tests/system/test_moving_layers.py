"""Placement with real node processes on simulated machines (a core each, a private TMPDIR, a CPU quota): the plan
follows measured speed and memory, moves live under a streaming answer with the same tokens, re-forms when nodes
join and leave, and refuses what cannot work."""

import asyncio
import time

import aiohttp
import orjson
import pytest

from helpers import EXACT, MODEL, chat_ids, complete_ids, golden
from meshws.tools import machines
from meshws.tools.launch import NodeProcess, free_port
from meshws.tools.machines import Machine

pytestmark = [pytest.mark.real_model, pytest.mark.processes,
              pytest.mark.skipif(not machines.available(), reason="needs root and cgroup v1's CPU controller")]

BUDGET = ("--memory", "80M")  # the embedded model is ~126 MiB with its embeddings and LM head (and each layer keeps
# room for 2,048 tokens of float32 KV, 3 MiB): no node holds it all
SLOW = 0.15  # of a core: an old machine
QUICK = ("--replan-seconds", "3")


class Mesh:
    """A head placing layers on core 0, and automatic nodes joining it, each a machine of its own."""

    def __init__(self, *head_args: str) -> None:
        self.port = free_port()
        self.head = Machine("--role", "head", "--layers", "auto", *EXACT, *BUDGET, *QUICK, *head_args,
                            name="head", core=0, port=self.port)
        self.nodes: dict[str, Machine] = {}

    def join(self, name: str, share: float = 1.0, core: int = 1, *args: str) -> Machine:
        node = Machine("--role", "auto", "--layers", "auto", *EXACT, *BUDGET, "--join",
                       f"http://127.0.0.1:{self.port}", *args, name=name, core=core, share=share)
        self.nodes[name] = node
        return node

    def url_of(self, name: str) -> str:
        return f"ws://127.0.0.1:{self.nodes[name].node.port}"

    def plan(self) -> dict:
        return self.head.node.health()["plan"]

    def spans(self) -> dict[str, tuple[int, int]]:
        """Each named node's span in the plan in force (replicas apart)."""
        names = {self.url_of(name): name for name in self.nodes if self.nodes[name].node.port}
        return {names.get(span["node"], span["node"]): tuple(span["layers"]) for span in self.plan()["spans"]
                if not span.get("replica")}

    def wait_plan(self, check, timeout: float = 90.0) -> dict:
        return machines.wait_for_plan(self.head.node, check, timeout)

    def stop(self) -> None:
        for node in [*self.nodes.values(), self.head]:
            node.stop()


async def stream(url: str, ids: list[int], max_tokens: int, on_chunk=None) -> str:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    parts = []
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.append(chunk["choices"][0]["text"])
                if on_chunk is not None:
                    await on_chunk(len(parts))
    return "".join(parts)


def node_named(mesh: Mesh, name: str) -> dict:
    return mesh.nodes[name].node.health()


def work(plan: dict, span: tuple[int, int]) -> float:
    """A span's work in mean layers, its LM head's as the plan weighs it."""
    from meshws.model.costs import gguf_costs
    from meshws.model.source import embedded_gguf_path

    costs = gguf_costs(embedded_gguf_path(), 4)
    lm_head = costs.lm_head_units * plan["lm_head_factor"] if span[1] == costs.total_layers else 0.0
    return costs.units(*span) + lm_head


async def test_the_plan_follows_measured_speed_and_moves_live_under_a_streaming_answer(tokenizer, reference_model):
    mesh = Mesh()
    try:
        mesh.join("fast")
        mesh.join("slow", SLOW)
        for machine in [mesh.head, *mesh.nodes.values()]:
            machine.node.wait_started()
        plan = mesh.wait_plan(lambda p: len(p["spans"]) == 3)
        spans = mesh.spans()
        assert work(plan, spans["slow"]) < work(plan, spans["fast"]), plan  # the slow machine: what budgets leave
        for name, span in spans.items():  # every span fits its node's budget, and the node serves it
            if name != "head":
                health = node_named(mesh, name)
                assert tuple(health["layers"]) == span and health["capacity"]["memory"] == 80 * 2**20
                assert health["weights"]["mapped_bytes"] <= 80 * 2**20

        ids = chat_ids(tokenizer, "Write a long, detailed story about a lighthouse keeper.")
        expected, _ = await complete_ids(mesh.head.node.url, ids, 12)
        assert expected == golden(reference_model, ids, 12)  # a split of the plan gives the whole model's tokens
        # 320 tokens: here the plan moved 45 s after the swap at token 40, by token 100 (a 0.15-core node holds a
        # span: 5 tokens a second); 700 tokens ran 4 minutes more and proved nothing more
        fault_free = await stream(mesh.head.node.url, ids, 320)
        version = mesh.plan()["version"]

        async def swap(chunks: int) -> None:
            if chunks == 40:  # mid-answer: the machines trade speeds
                mesh.nodes["fast"].set_share(SLOW)
                mesh.nodes["slow"].set_share(1.0)

        moved = asyncio.get_running_loop().run_in_executor(None, lambda: mesh.wait_plan(
            lambda p: p["version"] > version, timeout=120))
        with_move = await stream(mesh.head.node.url, ids, 320, on_chunk=swap)
        assert moved.done(), "the plan did not move while the answer streamed"
        assert with_move == fault_free  # the parked answer prefilled again on the new spans: the same tokens
        plan = await moved
        spans = mesh.spans()
        assert work(plan, spans["fast"]) < work(plan, spans["slow"]), plan  # they traded places
        assert any("parked while layers move" in line for line in mesh.head.node.lines)
        for name in ("fast", "slow"):  # the spans given up are let go: what is mapped is the new span's alone
            deadline = time.monotonic() + 10  # (the answer's close reaches each node just after its end)
            while (health := node_named(mesh, name))["sessions"] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert health["sessions"] == 0
            assert health["weights"]["mapped_bytes"] <= 80 * 2**20
            assert health["weights"]["resident_bytes"] <= 1.1 * health["weights"]["mapped_bytes"] + 2**20
    finally:
        mesh.stop()


async def test_joins_and_leaves_re_form_the_plan_and_an_answer_survives_a_leave(tokenizer):
    mesh = Mesh()
    try:
        mesh.join("slow", SLOW).node.wait_started()
        mesh.head.node.wait_started()
        deadline = time.monotonic() + 60
        while "no node has room" not in str(health := mesh.head.node.health()) and "not served" not in str(health):
            assert time.monotonic() < deadline, health["problems"]
            time.sleep(0.3)
        assert not health["ready"] and any("plan:" in problem for problem in health["problems"]), health
        mesh.join("fast").node.wait_started()  # two joiners cover the model: the slow one holds the least it can
        mesh.wait_plan(lambda p: len(p["spans"]) == 3)
        assert set(mesh.spans()) == {"head", "fast", "slow"}

        mesh.join("quick", core=0).node.wait_started()  # a fast node joins: the slow one is no longer needed
        joined = time.monotonic()
        mesh.wait_plan(lambda p: mesh.url_of("quick") in {s["node"] for s in p["spans"]}, timeout=30)
        assert time.monotonic() - joined < 30
        plan = mesh.plan()
        assert mesh.url_of("slow") in plan.get("left_out", []) or any(
            span.get("replica") for span in plan["spans"] if span["node"] == mesh.url_of("slow")), plan

        ids = chat_ids(tokenizer, "Explain in detail how a bicycle works.")
        fault_free = await stream(mesh.head.node.url, ids, 200)  # (the plan re-forms seconds after the leave)
        version = mesh.plan()["version"]

        left: list[float] = []

        async def leave(chunks: int) -> None:
            if chunks == 30:  # SIGTERM: it drains, and the plan goes on without it
                mesh.nodes["quick"].node.proc.terminate()
                left.append(time.monotonic())

        def without_quick() -> float:  # when the plan without it was in force (the answer's 200 tokens aside)
            mesh.wait_plan(lambda p: p["version"] > version and mesh.url_of("quick") not in
                           {s["node"] for s in p["spans"]}, timeout=150)
            return time.monotonic()

        reformed = asyncio.get_running_loop().run_in_executor(None, without_quick)
        with_leave = await stream(mesh.head.node.url, ids, 200, on_chunk=leave)
        assert left and await reformed - left[0] < 60
        assert with_leave == fault_free
        assert mesh.nodes["quick"].node.proc.wait(30) == 0  # it drained and exited cleanly
    finally:
        mesh.stop()


def test_hand_placed_and_automatic_nodes_mix(tokenizer):
    port = free_port()
    head = NodeProcess("--role", "head", "--layers", "0-9", *EXACT, name="head", port=port)
    join = ("--join", f"http://127.0.0.1:{port}", *EXACT)
    tail = NodeProcess("--role", "tail", "--layers", "20-29", *join, name="tail")
    auto = NodeProcess("--role", "middle", "--layers", "auto", *join, name="auto")  # it fills the gap between
    try:
        for node in (head, tail, auto):
            node.wait_started()
        deadline = time.monotonic() + 60
        while not (health := head.health())["ready"]:
            assert time.monotonic() < deadline, health["problems"]
            time.sleep(0.3)
        assert [hop["layers"] for hop in health["chain"]] == [[0, 10], [10, 20], [20, 30]]
        assert auto.health()["layers"] == [10, 20] and auto.health()["role"] == "middle"
        assert health["plan"]["automatic"] and health["plan"]["spans"][0] == {**health["plan"]["spans"][0],
                                                                              "node": "head", "layers": [0, 10]}
    finally:
        for node in (auto, tail, head):
            node.stop()


@pytest.mark.parametrize("args, needle", [
    (("--role", "auto", "--layers", "auto", "--memory", "2M"), "holds no span"),
    (("--role", "tail", "--layers", "15-29", "--memory", "20M"), "cannot hold layers 15-29"),
])
def test_a_budget_too_small_fails_the_start_with_a_reason(args, needle):
    node = NodeProcess(*args, "--join", "http://127.0.0.1:9", name="small")
    assert node.proc.wait(120) != 0
    node.stop()
    assert any(needle in line for line in node.lines), node.lines[-5:]
