"""The compute worker: steps that wait together run as one batch; a lone step runs alone, at once."""

import asyncio
import time

from fakes import CachedHeadBackend, FakeBackend
from meshws.mesh.compute import ComputeWorker
from meshws.model.backend import DecodeStep, TailTokenResult, TensorPayload


class _RecordingTail(FakeBackend):
    is_tail = True

    def __init__(self):
        super().__init__()
        self.batches = []
        self.alone = []

    def forward_bytes(self, body, shape, *, dtype="bfloat16", session_id=None, cache_mode=None, past_len=None,
                      sampling=None, history=(), generated_from=None):
        self.alone.append(session_id)
        return TailTokenResult("", 1)

    def decode_batch(self, steps):
        self.batches.append([s.session_id for s in steps])
        return [TailTokenResult("", 2) for _ in steps]


async def test_worker_batches_steps_that_arrive_together_and_runs_a_lone_step_alone():
    backend = _RecordingTail()
    worker = ComputeWorker(backend)
    try:
        blocker = asyncio.ensure_future(worker.call(time.sleep, 0.2))
        await asyncio.sleep(0.05)  # the worker is busy: the next steps queue up together
        results = await asyncio.gather(*(worker.decode(DecodeStep(f"s{i}", body=b"", shape=(1, 1, 8)))
                                         for i in range(4)))
        await blocker
        assert [r.token_id for r in results] == [2, 2, 2, 2]
        assert backend.batches == [["s0", "s1", "s2", "s3"]]
        solo = await worker.decode(DecodeStep("solo", body=b"", shape=(1, 1, 8)))
        assert solo.token_id == 1 and backend.alone == ["solo"] and len(backend.batches) == 1
    finally:
        worker.shutdown()


async def test_a_node_says_it_rests_before_a_result_leaves_it():
    # The next node, handed the result, looks whether this one still computes to choose its kernels' threads: told
    # after the result left, it could find this node busy and run its whole step on half the cores.
    rests, computed = [], []

    class Tail(_RecordingTail):
        def forward_bytes(self, *args, **kwargs):
            computed.append(time.monotonic())
            return super().forward_bytes(*args, **kwargs)

    def rest():
        began = time.monotonic()
        time.sleep(0.1)  # (a slow mark: made after the result went out, the caller would have the result first)
        rests.append((began, time.monotonic()))

    worker = ComputeWorker(Tail(), rest=rest)
    try:
        await asyncio.sleep(0.05)  # (the worker waits for work)
        result = await worker.decode(DecodeStep("s", body=b"", shape=(1, 1, 8)))
        received = time.monotonic()
        assert result.token_id == 1
        after = [done for began, done in rests if began > computed[0]]  # marks made once the step was computed
        assert after, "the node never said it rests after computing"
        assert all(done < received for done in after), "the result reached its caller before the mark was made"
        assert len(rests) == 1  # once a job (not on waking up as well)
    finally:
        worker.shutdown()


async def test_an_exception_in_a_job_reaches_its_caller_and_the_worker_goes_on():
    worker = ComputeWorker(FakeBackend())
    try:
        def boom():
            raise MemoryError("test")

        try:
            await worker.call(boom)
        except MemoryError as exc:
            assert str(exc) == "test"
        else:
            raise AssertionError("the exception was lost")
        assert await worker.call(lambda: 42) == 42
    finally:
        worker.shutdown()


class _ChunkedTail(FakeBackend):
    """A tail whose prefill takes `chunks` slow chunks and whose decode steps are quick; it records the order."""

    is_tail = True

    def __init__(self, chunk_seconds=0.05):
        super().__init__()
        self.chunk_seconds = chunk_seconds
        self.events = []

    def prefill(self, step, chunk_tokens):
        chunks = -(-step.length // chunk_tokens)
        for index in range(chunks):
            time.sleep(self.chunk_seconds)
            self.events.append(("chunk", step.session_id, index))
            if index + 1 < chunks:
                yield
        return TailTokenResult("", 7)

    def forward_bytes(self, body, shape, *, dtype="bfloat16", session_id=None, cache_mode=None, past_len=None,
                      sampling=None, history=(), generated_from=None):
        self.events.append(("decode", session_id))
        return TailTokenResult("", 1)

    def release_session(self, session_id):
        self.events.append(("release", session_id))
        return super().release_session(session_id)


def _prefill(sid, tokens):
    from meshws.model.backend import PrefillStep

    return PrefillStep(sid, body=b"", shape=(1, tokens, 8))


async def test_a_long_prefill_runs_in_chunks_with_decode_steps_and_releases_in_between():
    backend = _ChunkedTail()
    worker = ComputeWorker(backend, prefill_chunk=16)
    try:
        long = asyncio.ensure_future(worker.prefill(_prefill("long", 16 * 10)))  # 10 chunks
        await asyncio.sleep(0.02)
        for _ in range(3):
            assert (await worker.decode(DecodeStep("short", body=b"", shape=(1, 1, 8)))).token_id == 1
        assert await worker.release("gone") is True
        assert not long.done()
        assert (await long).token_id == 7
    finally:
        worker.shutdown()
    chunks = [i for i, event in enumerate(backend.events) if event[0] == "chunk"]
    others = [i for i, event in enumerate(backend.events) if event[0] != "chunk"]
    assert len(chunks) == 10 and worker.chunks == 10
    assert max(others) < chunks[-1], "decode steps and the release ran while the prefill was still going"
    # Each of them waited for one chunk at most: never two chunks in a row while they queued.
    assert all(others[k + 1] - others[k] <= 2 for k in range(len(others) - 1)), backend.events


async def test_a_release_jumps_ahead_of_queued_prefills():
    backend = _ChunkedTail(chunk_seconds=0.1)
    worker = ComputeWorker(backend, prefill_chunk=16)
    try:
        queued = [asyncio.ensure_future(worker.prefill(_prefill(f"p{i}", 16))) for i in range(4)]
        await asyncio.sleep(0.03)  # p0 runs; p1..p3 wait
        started = time.monotonic()
        await worker.release("s")
        assert time.monotonic() - started < 0.25  # one running chunk, not three queued prefills
        await asyncio.gather(*queued)
    finally:
        worker.shutdown()
    assert backend.events.index(("release", "s")) == 1


async def test_a_prefill_whose_caller_left_stops_after_its_current_chunk():
    backend = _ChunkedTail(chunk_seconds=0.05)
    worker = ComputeWorker(backend, prefill_chunk=16)
    try:
        long = asyncio.ensure_future(worker.prefill(_prefill("left", 16 * 20)))
        await asyncio.sleep(0.12)
        long.cancel()
        await asyncio.sleep(0.3)
        assert await worker.call(lambda: 1) == 1
    finally:
        worker.shutdown()
    ran = [event for event in backend.events if event[0] == "chunk"]
    assert 1 <= len(ran) <= 5, ran


class _PoisonedBatch(FakeBackend):
    """A tail whose batched decode raises if any row carries the poisoned session (a fake model's bug)."""

    is_tail = True

    def forward_bytes(self, body, shape, *, dtype="bfloat16", session_id=None, cache_mode=None, past_len=None,
                      sampling=None, history=(), generated_from=None):
        if session_id == "poison":
            raise ValueError("token id 123456 is outside the vocabulary")
        return TailTokenResult("", int(session_id[1:]))

    def decode_batch(self, steps):
        if any(step.session_id == "poison" for step in steps):
            raise RuntimeError("the whole batch failed")
        return [TailTokenResult("", int(step.session_id[1:])) for step in steps]


async def test_a_batch_that_raises_fails_only_the_row_at_fault():
    worker = ComputeWorker(_PoisonedBatch())
    try:
        blocker = asyncio.ensure_future(worker.call(time.sleep, 0.1))
        await asyncio.sleep(0.03)
        steps = [DecodeStep(sid, body=b"", shape=(1, 1, 8)) for sid in ("s1", "poison", "s2", "s3")]
        results = await asyncio.gather(*(worker.decode(step) for step in steps), return_exceptions=True)
        await blocker
    finally:
        worker.shutdown()
    assert [r.token_id for r in (results[0], results[2], results[3])] == [1, 2, 3]
    assert isinstance(results[1], ValueError) and "vocabulary" in str(results[1])
    assert worker.batches == 1


async def test_live_sessions_split_into_micro_batches_and_a_lone_session_never_waits():
    backend = _RecordingTail()
    live = {"count": 1}
    worker = ComputeWorker(backend, live_sessions=lambda: live["count"], micro_batches=lambda: 2)
    try:
        for _ in range(5):  # a lone session on a head with two groups in flight: no linger, ever
            assert (await worker.decode(DecodeStep("lone", body=b"", shape=(1, 1, 8)))).token_id == 1
        assert worker.lingers == 0 and backend.alone == ["lone"] * 5
        live["count"] = 8
        blocker = asyncio.ensure_future(worker.call(time.sleep, 0.2))
        await asyncio.sleep(0.05)
        await asyncio.gather(*(worker.decode(DecodeStep(f"s{i}", body=b"", shape=(1, 1, 8))) for i in range(8)))
        await blocker
        # Eight live sessions in two groups: two batches of four, in arrival order (no session's steps reordered).
        assert backend.batches == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]
        for _ in range(100):  # the worker thread notes a job just after its callers hear the result
            if len(worker.recent) == 8:
                break
            await asyncio.sleep(0.01)
        assert worker.busy_seconds >= 0.2 and len(worker.recent) == 8
        assert all(end >= start for start, end, _ in worker.recent)
    finally:
        worker.shutdown()


def _tail_of_eight(monkeypatch):
    """A tail with eight live sessions, whose linger would last 5 s if it were waited out."""
    from meshws.mesh import waves

    monkeypatch.setattr(waves, "LINGER", 5.0)
    backend = _RecordingTail()
    return backend, ComputeWorker(backend, live_sessions=lambda: 8)


async def test_a_partial_batch_waits_only_while_steps_keep_arriving(monkeypatch):
    # A tail with eight live sessions in two groups gets four steps at a time: it must not wait out the
    # whole linger for the other four, which come only after the head's next group.
    backend, worker = _tail_of_eight(monkeypatch)
    try:
        started = time.monotonic()
        await asyncio.gather(*(worker.decode(DecodeStep(f"s{i}", body=b"", shape=(1, 1, 8))) for i in range(4)))
        assert time.monotonic() - started < 2.5, "the partial batch waited out the linger"
        assert worker.lingers == 1 and backend.batches == [["s0", "s1", "s2", "s3"]]
    finally:
        worker.shutdown()


async def test_a_later_shard_waits_for_the_wave_its_previous_shard_announced(monkeypatch):
    # The head computed four steps in one batch and said so (`group`): the tail waits for all four, however they
    # trickle in, and runs them as one batch, without waiting for the other live sessions.
    backend, worker = _tail_of_eight(monkeypatch)
    try:
        def step(index):
            return worker.decode(DecodeStep(f"s{index}", body=b"", shape=(1, 1, 8), group=4))

        first = [asyncio.ensure_future(step(i)) for i in range(2)]
        await asyncio.sleep(0.05)  # far past the quiet period: a guessed wave would have run by now
        assert backend.batches == [] and not any(task.done() for task in first)
        started = time.monotonic()
        await asyncio.gather(*first, step(2), step(3))
        assert backend.batches == [["s0", "s1", "s2", "s3"]] and time.monotonic() - started < 2.5
    finally:
        worker.shutdown()


async def test_an_announced_wave_is_waited_for_while_its_steps_keep_coming(monkeypatch):
    # The previous shard's event loop sends a large wave's frames one by one: while they keep coming (each
    # within LINGER of the last) the tail waits for the whole announced wave; one that never comes holds the
    # rest only LINGER past the last that did.
    from meshws.mesh import waves

    backend, worker = _tail_of_eight(monkeypatch)
    monkeypatch.setattr(waves, "LINGER", 0.3)
    monkeypatch.setattr(waves, "WAVE_LINGER", 5.0)
    try:
        def step(index):
            return asyncio.ensure_future(worker.decode(DecodeStep(f"s{index}", body=b"", shape=(1, 1, 8), group=4)))

        steps = []
        for index in range(4):  # the last comes 0.45 s after the first: 1.5 LINGER
            steps.append(step(index))
            await asyncio.sleep(0.15)
        await asyncio.gather(*steps)
        assert backend.batches == [["s0", "s1", "s2", "s3"]], "the wave ran in parts"
        started = time.monotonic()
        await asyncio.gather(*(step(index) for index in range(3)))  # s3's step is lost
        assert backend.batches[-1] == ["s0", "s1", "s2"] and time.monotonic() - started < 2.5
    finally:
        worker.shutdown()


class _RecordingHead(CachedHeadBackend):
    """A head's layers (hidden states out, sent on to the tail); records its decode batches."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def decode_batch(self, steps):
        self.batches.append([step.session_id for step in steps])
        return super().decode_batch(steps)


def _one_wave_head(monkeypatch, linger, backend=None):
    """A head keeping one wave of four live sessions (`waves`), its longest wait `linger` (on `backend`, else a
    `_RecordingHead`); and a function that sends session `index`'s next decode step."""
    from meshws.mesh import waves

    monkeypatch.setattr(waves, "WAVE_LINGER", linger)
    backend = backend or _RecordingHead()
    worker = ComputeWorker(backend, live_sessions=lambda: 4, whole_wave=lambda: True)

    def step(index):
        backend._seq.setdefault(f"s{index}", 6)
        return asyncio.ensure_future(worker.decode(DecodeStep(f"s{index}", token_id=7)))

    return backend, worker, step


async def _wave_on_the_tail(worker, step, count=4):
    """Sessions 0 .. count - 1 send their steps while the worker is busy: they run as one wave, now on the tail."""
    blocker = asyncio.ensure_future(worker.call(time.sleep, 0.1))
    await asyncio.sleep(0.02)
    await asyncio.gather(*(step(index) for index in range(count)), blocker)


async def test_a_head_keeping_one_wave_waits_for_the_sessions_still_on_the_tail_and_never_for_a_lone_one(monkeypatch):
    # A head whose host's nodes lend each other their cores keeps every session in one batch (`waves`): when two
    # of a wave's four sessions are back and two are still on the tail, it waits for those, not for one returned
    # session, nor for a lone one's (nothing else in flight).
    backend, worker, step = _one_wave_head(monkeypatch, 5.0)  # a wait for a step that never came would show
    try:
        started = time.monotonic()
        for _ in range(3):
            await step(9)
        assert worker.lingers == 0 and backend.batches == [], "a lone session waited"
        worker.returned("s9")  # its step is back (its client reads slowly: its next step comes later)
        await _wave_on_the_tail(worker, step)  # one wave of four
        assert backend.batches == [["s0", "s1", "s2", "s3"]]
        early = [step(0), step(1)]  # back from the tail first
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in early), "the wave ran without the two still on the tail"
        await asyncio.gather(*early, step(2), step(3))
        assert backend.batches[-1] == ["s0", "s1", "s2", "s3"] and worker.lingers == 1
        worker.returned("s3")  # back too, but its answer ended: the others go on without it
        await asyncio.gather(step(0), step(1), step(2))
        assert backend.batches[-1] == ["s0", "s1", "s2"] and time.monotonic() - started < 2.5
    finally:
        worker.shutdown()


async def test_a_waves_part_that_ran_alone_is_waited_for_like_the_rest(monkeypatch):
    # A wave split in two (one session's step came late and ran alone while the other three were on the tail):
    # the lone part is on its way too, so the three wait for it and the wave is whole again the next round.
    backend, worker, step = _one_wave_head(monkeypatch, 0.3)
    try:
        await _wave_on_the_tail(worker, step, 3)  # s3's first step is not here yet
        await step(3)  # waits out WAVE_LINGER for the three on the tail, then runs alone
        assert backend.batches == [["s0", "s1", "s2"]]  # (s3 alone: the one-row path)
        rest = [step(0), step(1), step(2)]  # back from the tail while s3 is still there
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in rest), "the three ran without the part that ran alone"
        await asyncio.gather(*rest, step(3))
        assert backend.batches[-1] == ["s0", "s1", "s2", "s3"]
    finally:
        worker.shutdown()


async def test_a_session_joining_while_the_wave_is_on_the_tail_prefills_then_without_splitting_the_wave(monkeypatch):
    # A head keeping one wave idles while part of it is on the tail: a new session's prompt runs in that time
    # (its time to first token was rounds of waves), and the part of the wave already back waits for the rest.
    from meshws.model.backend import PrefillStep

    backend, worker, step = _one_wave_head(monkeypatch, 5.0)  # a wait for a step that never came would show
    try:
        await _wave_on_the_tail(worker, step)
        back = [step(0), step(1)]  # two back; s2 and s3 still on the tail
        await asyncio.sleep(0.05)
        joined = await asyncio.wait_for(worker.prefill(PrefillStep("new", token_ids=[5] * 6)), 2.0)
        assert joined.shape == [1, 6, 8] and backend.prefills == ["new"]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in back), "the wave's part that was back ran without the rest"
        await asyncio.gather(*back, step(2), step(3))
        assert backend.batches == [["s0", "s1", "s2", "s3"]] * 2
    finally:
        worker.shutdown()


class _TogetherHead(_RecordingHead):
    """A head whose new sessions' prompts may run together, with decode steps riding along; records those calls."""

    def __init__(self):
        super().__init__()
        self.prompt_calls = []

    def prefills_together(self, step):
        return True

    def prefill_batch(self, steps, decodes=()):
        self.prompt_calls.append(([step.session_id for step in steps], [step.session_id for step in decodes]))
        return [TensorPayload(body=b"\x00" * 16, shape=[1, 1, 8]) for _ in [*steps, *decodes]]


async def test_a_joining_prompt_takes_no_part_of_a_wave_along_and_that_part_waits_no_longer_than_wave_linger(
        monkeypatch):
    # While part of a kept wave is on the tail, a joining prompt runs alone: the part already back must not ride
    # along in its call (the wave would split for good). And however much other work comes meanwhile, that part
    # waits WAVE_LINGER after it came back at most, then runs without the rest (a lost or slow tail).
    from meshws.model.backend import PrefillStep

    backend, worker, step = _one_wave_head(monkeypatch, 0.3, _TogetherHead())
    try:
        await _wave_on_the_tail(worker, step)
        back = [step(0), step(1)]  # s2 and s3 never come back
        await asyncio.sleep(0.02)
        await asyncio.wait_for(worker.prefill(PrefillStep("new", token_ids=[5] * 6)), 2.0)
        assert backend.prompt_calls == [] and backend.prefills == ["new"], "the prompt took the wave's part along"
        first = asyncio.ensure_future(worker.call(time.sleep, 0.4))  # other work, past the part's WAVE_LINGER
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(worker.call(time.sleep, 0.4))
        await asyncio.wait_for(asyncio.gather(*back), 2.0)
        assert not second.done(), "the wave's part waited behind other work past WAVE_LINGER"
        assert backend.batches == [["s0", "s1", "s2", "s3"], ["s0", "s1"]]
        await asyncio.gather(first, second)
    finally:
        worker.shutdown()


class _TogetherTail(_ChunkedTail):
    """Short prompts of new sessions may run together; records each call of several."""

    def __init__(self, fail=False):
        super().__init__(chunk_seconds=0.0)
        self.together, self.rides, self.fail = [], [], fail

    def prefills_together(self, step):
        return step.length <= 8

    def prefill_batch(self, steps, decodes=()):  # (and decode steps along: `rides`, their token 3)
        if self.fail:
            raise MemoryError("no memory for the batch")
        (self.rides if decodes else self.together).append(([step.session_id for step in steps],
                                                           [step.session_id for step in decodes]))
        return [TailTokenResult("", 9) for _ in steps] + [TailTokenResult("", 3) for _ in decodes]


async def _busy(worker):
    """The worker kept busy for 0.2 s (the blocker's future): what is submitted meanwhile queues up together."""
    blocker = asyncio.ensure_future(worker.call(time.sleep, 0.2))
    await asyncio.sleep(0.05)
    return blocker


async def test_new_sessions_prompts_queued_together_prefill_in_one_call_and_alone_if_it_fails():
    for fail in (False, True):
        backend = _TogetherTail(fail)
        worker = ComputeWorker(backend, prefill_chunk=16)
        try:
            blocker = await _busy(worker)  # the prompts queue up
            # a, b and c fit a chunk together (8 + 4 + 4 tokens); "long" may not join, d would pass the chunk
            results = await asyncio.gather(*(worker.prefill(_prefill(sid, tokens)) for sid, tokens in
                                             (("a", 8), ("long", 20), ("b", 4), ("c", 4), ("d", 2))))
            await blocker
            if fail:  # each on its own, as if it had never been tried together
                assert backend.together == [] and [r.token_id for r in results] == [7] * 5
                assert sorted(sid for _, sid, _ in backend.events) == ["a", "b", "c", "d", "long", "long"]
            else:
                assert backend.together == [(["a", "b", "c"], [])] and worker.prefill_batches == 1
                assert [r.token_id for r in results] == [9, 7, 9, 9, 7]
                assert ("chunk", "a", 0) not in backend.events and ("chunk", "d", 0) in backend.events
        finally:
            worker.shutdown()


class _RidingTail(_TogetherTail):
    """Records its decode batches too."""

    def __init__(self, fail=False):
        super().__init__(fail)
        self.batches, self.chunks_before = [], []  # (chunks run before each batch)

    def decode_batch(self, steps):
        self.batches.append([step.session_id for step in steps])
        self.chunks_before.append(len(self.events))
        return [TailTokenResult("", 2) for _ in steps]


async def test_a_decode_batch_takes_new_sessions_prompts_along_in_one_call_and_each_alone_if_it_fails():
    for fail in (False, True):
        backend = _RidingTail(fail)
        worker = ComputeWorker(backend, prefill_chunk=16)
        try:
            blocker = await _busy(worker)  # two running sessions' steps and three prompts queue up
            decoded = [asyncio.ensure_future(worker.decode(DecodeStep(f"s{i}", body=b"", shape=(1, 1, 8))))
                       for i in range(2)]
            prompts = [asyncio.ensure_future(worker.prefill(_prefill(sid, tokens)))
                       for sid, tokens in (("a", 8), ("long", 20), ("b", 4))]
            await blocker
            decoded, prompts = await asyncio.gather(*decoded), await asyncio.gather(*prompts)
            if fail:  # the steps as one decode batch at once (they waited one call), then the prompts each on its
                # own: nothing lost, nothing twice
                assert backend.rides == [] and backend.batches == [["s0", "s1"]] and worker.rides == 0
                assert backend.chunks_before == [0], "the steps waited for the failed call and then for prompts"
                assert [r.token_id for r in decoded] == [2, 2] and [r.token_id for r in prompts] == [7, 7, 7]
                assert sorted(sid for _, sid, _ in backend.events) == ["a", "b", "long", "long"]
            else:  # the short prompts ride with the steps; "long" (past a chunk) runs in its own turns
                assert backend.rides == [(["a", "b"], ["s0", "s1"])] and backend.batches == []
                assert worker.rides == 1 and worker.prefill_batches == 1
                assert [r.token_id for r in decoded] == [3, 3] and [r.token_id for r in prompts] == [9, 7, 9]
                assert [sid for _, sid, _ in backend.events] == ["long", "long"]
        finally:
            worker.shutdown()


class _AnyLengthTail(_RidingTail):
    """A backend whose kernel would take a prompt of any length in one call (a GGUF's blocks); a step of session
    "slow" takes 0.2 s."""

    def prefills_together(self, step):
        return True

    def forward_bytes(self, body, shape, **kwargs):
        time.sleep(0.2 if kwargs.get("session_id") == "slow" else 0)
        return super().forward_bytes(body, shape, **kwargs)


async def test_a_prompt_past_a_chunk_never_runs_whole_in_one_call_even_where_the_backend_would_take_it():
    # Its turn comes with decode steps waiting (they would ride along a prompt that may join): it still runs a
    # chunk a turn, so the running sessions' next steps wait one chunk at most, not the whole prompt.
    backend = _AnyLengthTail()
    worker = ComputeWorker(backend, prefill_chunk=16)
    try:
        slow = asyncio.ensure_future(worker.decode(DecodeStep("slow", body=b"", shape=(1, 1, 8))))
        await asyncio.sleep(0.05)  # the slow step runs; behind it the prompt, then two sessions' steps
        prompt = asyncio.ensure_future(worker.prefill(_prefill("long", 40)))
        await asyncio.sleep(0.01)
        decoded = [asyncio.ensure_future(worker.decode(DecodeStep(f"s{i}", body=b"", shape=(1, 1, 8))))
                   for i in range(2)]
        await slow
        decoded, prompt = await asyncio.gather(*decoded), await prompt
        assert backend.rides == [] and backend.together == [] and prompt.token_id == 7
        chunks = [event for event in backend.events if event[0] == "chunk"]
        assert chunks == [("chunk", "long", index) for index in range(3)] and backend.batches == [["s0", "s1"]]
        assert [r.token_id for r in decoded] == [2, 2]
    finally:
        worker.shutdown()


class _SlowPromptsTail(_RidingTail):
    """Its calls of several prompts take 0.15 s."""

    def prefill_batch(self, steps, decodes=()):
        time.sleep(0.15)
        return super().prefill_batch(steps, decodes)


async def test_a_decode_step_waits_one_prompts_call_at_most_never_a_second_in_its_own_batch():
    # A step that comes while prompts are being prefilled runs in the next turn without more prompts along
    # (they run in the turn after): else it would wait for the running call and then for another chunk in its own.
    backend = _SlowPromptsTail()
    worker = ComputeWorker(backend, prefill_chunk=16)
    try:
        blocker = await _busy(worker)
        first = [asyncio.ensure_future(worker.prefill(_prefill(sid, 4))) for sid in ("a", "b")]
        await blocker
        await asyncio.sleep(0.05)  # a and b are being prefilled together: a step and two more prompts come
        step = asyncio.ensure_future(worker.decode(DecodeStep("s0", body=b"", shape=(1, 1, 8))))
        later = [asyncio.ensure_future(worker.prefill(_prefill(sid, 4))) for sid in ("c", "d")]
        await asyncio.gather(*first, step, *later)
        assert backend.together == [(["a", "b"], []), (["c", "d"], [])] and backend.rides == []
        assert ("decode", "s0") in backend.events  # alone, between the two calls
    finally:
        worker.shutdown()
