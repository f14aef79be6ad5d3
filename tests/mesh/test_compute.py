"""The compute worker: steps that wait together run as one batch; a lone step runs alone, at once."""

import asyncio
import time

from fakes import FakeBackend
from meshws.mesh.compute import ComputeWorker
from meshws.model.backend import DecodeStep, TailTokenResult


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
