"""Registry, route planning, replicas and failover, with real processes (issue: failover)."""

import asyncio
import signal
import time

import aiohttp
import orjson
import pytest

from helpers import EXACT, MODEL, chat_ids, complete_ids, golden
from meshws.tools.launch import NodeProcess, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

ONE_THREAD = ("--threads", "1")  # several nodes share two cores: spinning OpenMP threads would fight
STORY = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


class Cluster:
    """A head and the nodes that --join it; everything stopped at the end."""

    def __init__(self, head_layers: str, *head_flags: str) -> None:
        self.port = free_port()
        self.head = NodeProcess("--role", "head", "--layers", head_layers, *EXACT, *ONE_THREAD, "--registry-ttl", "4",
                                *head_flags, name="head", port=self.port).wait_started()
        self.nodes: list[NodeProcess] = []

    def join(self, role: str, layers: str, port: int = 0, flags: tuple[str, ...] = ()) -> NodeProcess:
        node = NodeProcess("--role", role, "--layers", layers, *EXACT, *ONE_THREAD, *flags,
                           "--join", f"http://127.0.0.1:{self.port}",
                           name=f"{role} {layers} #{len(self.nodes)}", port=port)
        self.nodes.append(node)
        return node

    def replica_tails(self, count: int = 2, flags: tuple[str, ...] = ()) -> list[NodeProcess]:
        """`count` tails for layers 15-29, started and joined (the head's link to each up)."""
        tails = [self.join("tail", "15-29", flags=flags) for _ in range(count)]
        for tail in tails:
            tail.wait_started()
        self.wait_nodes(len(self.nodes))
        return tails

    def wait_nodes(self, count: int, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            health = self.head.health()
            links_up = sum(link["state"] == "up" for link in health["links"])
            if len(health["nodes"]) == count and health["ready"] and links_up == count:
                return health  # every joined node registered, and the head's link to each is up
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} nodes: {health['nodes']} {health['problems']}")
            time.sleep(0.2)

    def stop(self) -> None:
        for node in self.nodes + [self.head]:
            node.stop()


async def stream_text(url, messages, max_tokens, on_chunk=None, user=None, usage=None):
    """The streamed answer's text; `usage` (a list) gets its usage; `user`: with the client's address, who may
    adopt a warm session."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **({"user": user} if user else {}), **({"stream_options": {"include_usage": True}} if usage else {})}
    parts, events = [], []
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                events.append(line[6:].strip())
                if events[-1] == b"[DONE]":
                    break
                chunk = orjson.loads(events[-1])
                assert "error" not in chunk, chunk
                if chunk.get("usage") and usage is not None:
                    usage.append(chunk["usage"])
                if chunk["choices"]:
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
                if on_chunk:
                    on_chunk(len(parts))
    return "".join(parts)


def serving_tail_killer(tails, at_chunk):
    """A stream callback that SIGKILLs the one replica serving the session once `at_chunk` chunks came; and
    the list of what it killed."""
    killed = []

    def kill_serving_tail(chunks):
        if chunks >= at_chunk and not killed:
            serving = [tail for tail in tails if tail.health()["sessions"] == 1]
            assert len(serving) == 1, "exactly one replica serves the session"
            serving[0].kill()
            killed.append(serving[0])

    return kill_serving_tail, killed


async def test_killing_the_serving_tail_mid_answer_keeps_the_answer(tokenizer):
    cluster = Cluster("0-14")
    try:
        tails = cluster.replica_tails()
        health = cluster.head.health()
        assert {tuple(n["layers"]) for n in health["nodes"]} == {(15, 30)}
        messages = [{"role": "user", "content": STORY}]
        fault_free = await stream_text(cluster.head.url, messages, 90)
        assert len(fault_free) > 200

        kill_serving_tail, killed = serving_tail_killer(tails, at_chunk=25)
        started = time.monotonic()
        with_fault = await stream_text(cluster.head.url, messages, 90, on_chunk=kill_serving_tail)
        assert killed, "the tail was never killed"
        assert with_fault == fault_free  # greedy, float32: the re-prefill continues exactly
        survivor = next(tail for tail in tails if tail not in killed)
        assert survivor.wait_sessions(0)["sessions"] == 0
        assert any("failover" in line for line in cluster.head.lines)
        # The dead tail leaves the registry within a few seconds.
        deadline = time.monotonic() + 15
        while len(cluster.head.health()["nodes"]) != 1:
            assert time.monotonic() < deadline, cluster.head.health()["nodes"]
            time.sleep(0.3)
        assert time.monotonic() - started < 60
        assert cluster.head.health()["nodes"][0]["url"] == f"ws://127.0.0.1:{survivor.port}"
    finally:
        cluster.stop()


CHAOS_PROMPTS = [
    f"Write a long, detailed story about {subject}." for subject in (
        "a lighthouse keeper", "a baker in Paris", "a robot who paints", "a lost dog", "a mountain village",
        "a sailor's first voyage", "a clockmaker", "a garden in winter", "a train across the desert",
        "a young astronomer", "a fisherman and the sea", "an old library", "a violin maker",
        "a city under snow", "a beekeeper", "a bridge builder")
]


async def test_sixteen_streams_survive_killing_each_replica_tail_in_turn(tokenizer):
    """Chaos: two replica tails; one is SIGKILLed mid-answer and restarted on its port, then the other."""
    cluster = Cluster("0-14")
    try:
        tails = cluster.replica_tails()
        conversations = [[{"role": "user", "content": prompt}] for prompt in CHAOS_PROMPTS]
        max_tokens = 128  # (answers that outlast a tail's restart: 64 ended before it, once decoding got faster)
        fault_free = await asyncio.gather(*(stream_text(cluster.head.url, m, max_tokens) for m in conversations))
        assert sum(link["wave_frames"] for link in cluster.head.health()["links"]) > 0  # waves crossed as frames

        progress = [0] * len(conversations)

        def counter(index):
            def on_chunk(chunks):
                progress[index] = chunks
            return on_chunk

        async def until(chunks_each):
            while min(progress) < chunks_each:
                await asyncio.sleep(0.02)

        async def chaos():
            await until(6)
            first = max(tails, key=lambda tail: tail.health()["sessions"])
            assert first.health()["sessions"] > 0
            first.kill()
            restarted = await asyncio.to_thread(lambda: cluster.join("tail", "15-29", port=first.port).wait_started())
            await asyncio.to_thread(cluster.wait_nodes, 2)
            second = next(tail for tail in tails if tail is not first)
            serving = second.health()["sessions"]  # every session failed over onto it
            second.kill()
            return restarted, serving

        streams = asyncio.gather(*(stream_text(cluster.head.url, m, max_tokens, on_chunk=counter(i))
                                   for i, m in enumerate(conversations)))
        (restarted, serving), with_faults = await asyncio.gather(chaos(), streams)
        assert serving > 0, "every answer had ended before the second kill: nothing was tested"
        assert with_faults == fault_free  # greedy, float32: every re-prefill continues exactly
        assert restarted.wait_sessions(0)["sessions"] == 0
        assert cluster.head.health()["generations"] == 0
        assert sum("failover" in line for line in cluster.head.lines) >= 2
    finally:
        cluster.stop()


async def test_dynamic_three_node_chain_matches_generate_and_sessions_spread(tokenizer, reference_model):
    cluster = Cluster("0-9")
    try:
        for role, layers in (("middle", "10-19"), ("tail", "20-29")):
            cluster.join(role, layers).wait_started()
        health = cluster.wait_nodes(2)
        assert [hop["layers"] for hop in health["chain"]] == [[0, 10], [10, 20], [20, 30]]
        ids = chat_ids(tokenizer, "Explain in detail how a bicycle works.")
        tokens, _ = await complete_ids(cluster.head.url, ids, 24)
        assert tokens == golden(reference_model, ids, 24)  # == the static chain (test_mesh_processes)
        for node in cluster.nodes:
            assert node.wait_sessions(0)["sessions"] == 0
    finally:
        cluster.stop()


async def test_missing_layers_get_503_until_a_node_joins():
    cluster = Cluster("0-14")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{cluster.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 503
                assert response.headers.get("Retry-After")
                assert "layers 15-29 are not served" in (await response.json())["error"]["message"]
            assert "layers 15-29 are not served" in cluster.head.health()["problems"][0]
            async with client.get(f"{cluster.head.url}/health") as response:  # what a load balancer sees
                health = await response.json()
                assert response.status == 503 and health["status"] == "unavailable" and not health["ready"]
                assert "layers 15-29 are not served" in health["problems"][0]
            cluster.join("tail", "15-29").wait_started()
            cluster.wait_nodes(1)
            async with client.get(f"{cluster.head.url}/health") as response:
                assert response.status == 200 and (await response.json())["status"] == "ok"
            async with client.post(f"{cluster.head.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert (await response.json())["usage"]["completion_tokens"] >= 1
    finally:
        cluster.stop()


async def test_automatic_tails_cover_the_gap_and_the_second_replicates_the_first():
    cluster = Cluster("0-9")
    try:
        first = cluster.join("tail", "auto")
        second = cluster.join("tail", "auto")
        first.wait_started()
        second.wait_started()
        cluster.wait_nodes(2)
        # The head's plan: the gap, and a replica of it (as fast). A node not yet measured when the first plan is
        # made waits outside it on the probe layer (1, 2) until a later plan adds it as the replica. (On a loaded
        # 2-core host its probes may read it 1.5x slower than the first for a while: the head weighs it again each
        # replan; CI once took over 60 s. Or faster on its one layer: then the best chain has it as the tail, and
        # CI once saw the tail swap six times and the spare stay out, until weighing spares kept the chain in force.)
        deadline = time.monotonic() + 120
        while True:
            health = cluster.head.health()
            spans = sorted(tuple(node["layers"]) for node in health["nodes"])
            if health["plan"]["state"] == "live" and spans == [(10, 30), (10, 30)]:
                break
            nodes = [(node["url"], node["layers"], node.get("measured")) for node in health["nodes"]]
            assert time.monotonic() < deadline, orjson.dumps([health["plan"], nodes]).decode()
            time.sleep(0.2)
        assert health["ready"] and sum(span.get("replica", False) for span in health["plan"]["spans"]) == 1
        # Two generations at once spread across the replicas (the less loaded one is chosen).
        messages = [{"role": "user", "content": STORY}]
        await asyncio.gather(stream_text(cluster.head.url, messages, 30), stream_text(cluster.head.url, messages, 30))
        deadline = time.monotonic() + 10  # the close reaches the tails just after the answers end
        while (served := [sum(" closed: " in line for line in node.lines) for node in (first, second)]) != [1, 1]:
            assert time.monotonic() < deadline, served
            time.sleep(0.1)
    finally:
        cluster.stop()


async def test_a_draining_replica_finishes_its_answer_while_new_ones_go_to_the_other(tokenizer):
    cluster = Cluster("0-14")
    try:
        tails = cluster.replica_tails()
        messages = [{"role": "user", "content": STORY}]
        fault_free = await stream_text(cluster.head.url, messages, 40)
        drained = []

        def drain_serving_tail(chunks):
            if chunks == 5 and not drained:
                serving = next(tail for tail in tails if tail.health()["sessions"] == 1)
                serving.proc.send_signal(signal.SIGTERM)
                drained.append(serving)

        long_answer = asyncio.create_task(stream_text(cluster.head.url, messages, 40, on_chunk=drain_serving_tail))
        while not drained:
            await asyncio.sleep(0.05)
        other = next(tail for tail in tails if tail is not drained[0])
        deadline = time.monotonic() + 10
        while not any(node["draining"] for node in cluster.head.health()["nodes"]):
            assert time.monotonic() < deadline, "the head never heard that the tail drains"
            await asyncio.sleep(0.05)
        def closed_sessions(node):
            return sum("session" in line and " closed: " in line for line in node.lines)

        before = closed_sessions(other)
        # Three at once: by load alone (1 on the draining tail, 0 on the other) one would go to the draining tail.
        shorts = await asyncio.gather(*(stream_text(cluster.head.url, [{"role": "user", "content": prompt}], 6)
                                        for prompt in ("Name a colour.", "Name a fruit.", "Name a bird.")))
        assert all(shorts)
        assert await long_answer == fault_free  # the draining tail finished it, no failover
        assert not any("failover" in line for line in cluster.head.lines)
        assert await asyncio.to_thread(drained[0].proc.wait, 60) == 0
        assert other.wait_sessions(0)["sessions"] == 0
        assert closed_sessions(other) == before + 3  # every new answer ran on the other replica
    finally:
        cluster.stop()


REPEAT = ("Copy this list exactly, one item per line: red apple, green pear, yellow banana, purple plum, "
          "orange mango, red apple, green pear, yellow banana, purple plum, orange mango.")


async def test_a_tail_killed_during_a_lap_carrying_drafts_leaves_the_answer_unchanged(tokenizer):
    """Speculative decoding (the head's default): a repeating answer keeps most laps full of drafts; the tail
    serving it dies while such a lap is on its way. The head routes around it and re-prefills what was accepted
    (never the lost drafts): the text is the fault-free one."""
    cluster = Cluster("0-14")
    try:
        tails = cluster.replica_tails()
        messages = [{"role": "user", "content": REPEAT}]
        fault_free = await stream_text(cluster.head.url, messages, 72)
        kill_serving_tail, killed = serving_tail_killer(tails, at_chunk=30)
        with_fault = await stream_text(cluster.head.url, messages, 72, on_chunk=kill_serving_tail)
        assert killed and with_fault == fault_free
        lost = [line for line in cluster.head.lines if "lost a lap with" in line]
        assert len(lost) == 1 and int(lost[0].split("lost a lap with ")[1].split()[0]) > 0, lost
        survivor = next(tail for tail in tails if tail not in killed)
        assert survivor.wait_sessions(0)["sessions"] == 0
    finally:
        cluster.stop()


def no_copies(node, timeout=8.0):
    """The node's health once it holds no standby copies (they go a moment after their session closes)."""
    deadline = time.monotonic() + timeout
    while (health := node.wait_sessions(0))["standbys"]:
        assert time.monotonic() < deadline, f"{node.name} still holds {health['standbys']} standby copies"
        time.sleep(0.1)
    return health


def counted_failovers(head, timeout=8.0):
    """The head's failover counts once one is counted (at the answer's end, just after its last token)."""
    deadline = time.monotonic() + timeout
    while (failovers := head.health()["failovers"])["failovers"] == 0:
        assert time.monotonic() < deadline, [line for line in head.lines if "fail" in line]
        time.sleep(0.1)
    return failovers


LONG_STORY = STORY + " " + " ".join(
    f"In chapter {n} the keeper climbs the {n * 7} steps, trims the wick and writes the weather in the log." for n
    in range(1, 31))


@pytest.mark.parametrize("fault", ["kill", "drain", "lagging standby", "standby off"])
async def test_a_standby_resumes_the_answer_without_prefilling_it_again(tokenizer, fault):
    """Two replica tails: the one serving a long prompt's answer is SIGKILLed (or drained with --drain-timeout 1)
    mid-answer. Its standby, the other tail, holds a copy of the session's KV it was fed after every step: the
    head resumes there, running again only what the copy lacked; the text is the fault-free one. A lagging
    standby (SIGSTOPped from token 5 until the kill at 18, or 1.5 s after the stop if that comes first) holds the
    prompt but not the tokens after: the answer did not wait for it, and those positions run again. (The pause stays
    inside the 2.5 s a link waits for a ping's pong, half its 5 s heartbeat, however slowly the host decodes: a peer
    paused past it loses its links, as one that died does; CI once paused 2.5 s and lost it.) With --standby off
    the head prefills everything again,
    and the text is the same too."""
    cluster = Cluster("0-14", *(("--standby", "off") if fault == "standby off" else ()))
    try:
        tails = cluster.replica_tails(flags=("--drain-timeout", "1") if fault == "drain" else ())
        messages = [{"role": "user", "content": LONG_STORY}]
        prompt_tokens = len(chat_ids(tokenizer, LONG_STORY))
        assert prompt_tokens > 500
        fault_free = await stream_text(cluster.head.url, messages, 60)
        for tail in tails:
            assert no_copies(tail)["sessions"] == 0  # the fault-free answer's copy went with it

        hit, stopped, paused = [], [], []

        def strike(chunks):
            if fault == "lagging standby" and chunks >= 5 and not stopped:
                stopped.extend(tail for tail in tails if tail.health()["sessions"] == 0)  # the standby
                stopped[0].proc.send_signal(signal.SIGSTOP)
                paused.append(time.monotonic())
            late = bool(paused) and time.monotonic() - paused[0] >= 1.5
            if (chunks >= (18 if fault == "lagging standby" else 25) or late) and not hit:
                serving = next(tail for tail in tails if tail not in stopped and tail.health()["sessions"] == 1)
                serving.proc.send_signal(signal.SIGTERM) if fault == "drain" else serving.kill()
                hit.append(serving)
                for standby in stopped:
                    standby.proc.send_signal(signal.SIGCONT)

        with_fault = await stream_text(cluster.head.url, messages, 60, on_chunk=strike)
        assert hit and with_fault == fault_free
        failovers = counted_failovers(cluster.head)
        assert failovers["failovers"] == 1
        if fault == "standby off":
            assert failovers["standby_resumes"] == 0 and failovers["recomputed_tokens"] > prompt_tokens
        elif fault == "lagging standby":
            assert failovers["standby_resumes"] == 1
            assert 3 <= failovers["recomputed_tokens"] < prompt_tokens // 4, failovers  # the tokens it missed
        else:
            assert failovers["standby_resumes"] == 1
            assert failovers["recomputed_tokens"] < 16, failovers  # the last step or two, not the prompt
        survivor = next(tail for tail in tails if tail is not hit[0])
        assert no_copies(survivor)["sessions"] == 0  # nothing left of the answer (kept prompt prefixes aside)
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{cluster.head.url}/metrics") as response:
                metrics = await response.text()
        resumed = "standby" if fault != "standby off" else "prefill"
        assert f'meshws_failovers_total{{resumed="{resumed}"}} 1.0' in metrics
    finally:
        cluster.stop()


async def chat_turns(url, questions, between=None):
    """One /ws/chat conversation: each question's answer (greedy), `between(turn)` awaited after each."""
    messages, texts = [], []
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{url}/ws/chat") as ws:
            for turn, question in enumerate(questions):
                messages.append({"role": "user", "content": question})
                await ws.send_json({"type": "chat", "messages": messages, "max_tokens": 40, "temperature": 0})
                while (message := await ws.receive_json(timeout=120))["type"] != "done":
                    assert message["type"] != "error", message
                texts.append(message["text"])
                messages.append({"role": "assistant", "content": message["text"]})
                if between is not None:
                    await between(turn)
    return texts


@pytest.mark.parametrize("tail_after", ["restarted", "gone"])
async def test_a_conversation_outlives_its_tail_between_turns_on_the_standby(tokenizer, tail_after):
    """A /ws/chat conversation's tail is SIGKILLed between turns (and restarted on its port, empty, or not). The
    next turn goes on from the standby's copy of the conversation's KV (a cache miss on the restarted tail, or
    its link gone): the same answer as without the fault."""
    cluster = Cluster("0-14")
    try:
        tails = cluster.replica_tails()
        questions = [LONG_STORY, "Now tell me what the keeper wrote on the last page of the log."]
        fault_free = await chat_turns(cluster.head.url, questions)
        no_copies(tails[0]), no_copies(tails[1])

        async def kill_serving_tail(turn):
            if turn == 0:
                serving = next(tail for tail in tails if tail.health()["sessions"] == 1)
                serving.kill()
                if tail_after == "restarted":
                    await asyncio.to_thread(lambda: cluster.join("tail", "15-29", port=serving.port).wait_started())
                    await asyncio.to_thread(cluster.wait_nodes, 2)

        assert await chat_turns(cluster.head.url, questions, kill_serving_tail) == fault_free
        said = [line[-160:] for line in cluster.head.lines if "session" in line][-8:]
        assert counted_failovers(cluster.head)["standby_resumes"] == 1, said
        for node in cluster.nodes:
            if node.proc.poll() is None:
                assert no_copies(node)["sessions"] == 0
    finally:
        cluster.stop()


async def test_a_warm_api_session_outlives_its_tail_on_the_standby(tokenizer):
    """`--warm-sessions 1`: an HTTP answer's session stays open for the same client's next turn. Its tail is
    SIGKILLed between the turns; the next turn adopts the warm session and goes on from the standby's copy of its
    KV, answering as it would have without the fault. (`user` "a" and "b": two conversations, the pool's bound
    ends the first when the second's first answer ends, so one session is open when the tail is hit.)"""
    cluster = Cluster("0-14", "--warm-sessions", "1")
    try:
        tails = cluster.replica_tails()
        first = [{"role": "user", "content": LONG_STORY}]

        async def turns(user, between):
            answer = await stream_text(cluster.head.url, first, 30, user=user)
            await between()
            follow = first + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": "What did the keeper write on the last page of the log?"}]
            usage = [{}]
            again = await stream_text(cluster.head.url, follow, 30, user=user, usage=usage)
            return answer, again, usage[-1]["prompt_tokens_details"]["cached_tokens"]

        async def nothing():
            pass

        async def kill_serving_tail():
            deadline = time.monotonic() + 8
            while sorted(counts := [tail.health()["sessions"] for tail in tails]) != [0, 1]:
                assert time.monotonic() < deadline, f"the open sessions did not settle on one: {counts}"
                await asyncio.sleep(0.1)
            tails[counts.index(1)].kill()

        *fault_free, cached = await turns("a", nothing)
        *with_fault, cached_after_fault = await turns("b", kill_serving_tail)
        assert with_fault == fault_free
        failovers = counted_failovers(cluster.head)
        assert failovers["standby_resumes"] == 1 and failovers["failovers"] == 1, failovers
        assert cached > len(chat_ids(tokenizer, LONG_STORY))  # the first turn, kept
        assert cached - 16 < cached_after_fault <= cached  # the standby's copy: only its last step or two again
    finally:
        cluster.stop()


@pytest.mark.parametrize("hit", ["tail", "middle"])
async def test_in_three_parts_a_standby_resumes_the_answer_and_the_other_hops_keep_their_caches(tokenizer, hit):
    """Head, middle, tail, with two replicas of the hop that is SIGKILLed mid-answer. A tail's standby: the middle
    keeps the session and its cache and sends on to it (the head's resume names the new last hop). A middle's
    standby: the tail keeps the session's cache a while (its hop before had a standby), and the standby sends on to
    it. Either way only what the copy lacked runs again, the text is the same, and nothing is left after."""
    cluster = Cluster("0-9")
    try:
        middles = [cluster.join("middle", "10-19").wait_started() for _ in range(2 if hit == "middle" else 1)]
        tails = [cluster.join("tail", "20-29").wait_started() for _ in range(2 if hit == "tail" else 1)]
        cluster.wait_nodes(3)
        messages = [{"role": "user", "content": LONG_STORY}]
        fault_free = await stream_text(cluster.head.url, messages, 60)
        kill_serving, killed = serving_tail_killer(tails if hit == "tail" else middles, at_chunk=25)
        assert await stream_text(cluster.head.url, messages, 60, on_chunk=kill_serving) == fault_free
        assert killed
        failovers = counted_failovers(cluster.head)
        assert failovers["standby_resumes"] == 1 and failovers["recomputed_tokens"] < 16, failovers
        failed_over = {line.split("session ")[1].split(":")[0] for line in cluster.head.lines if "re-routing" in line}
        assert len(failed_over) == 1  # the answer's session (its id's first 12 digits, as the logs name it)
        kept = middles[0] if hit == "tail" else tails[0]  # the hop that was not hit: its cache went on
        assert not any(f"session {sid} re-opened" in line for sid in failed_over for line in kept.lines)
        closed = [line for line in kept.lines if " closed: " in line]  # (a session's summary when it ends)
        assert closed and all(", 0 cache misses" in line for line in closed[-2:]), closed
        for node in middles + tails:
            if node not in killed:
                assert no_copies(node)["sessions"] == 0
    finally:
        cluster.stop()
