"""The admission queue on its own: first in, first out; a full queue, a timeout and a drain refuse."""

import asyncio

import pytest

from meshws.head.admission import AdmissionQueue, Refused


async def test_waiters_get_slots_in_arrival_order_and_a_full_queue_refuses_at_once():
    queue = AdmissionQueue(slots=1, max_queue=2, timeout=5)
    first = await queue.enter()
    order = []

    async def wait(name):
        slot = await queue.enter()
        order.append(name)
        return slot

    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    third = asyncio.create_task(wait("third"))
    await asyncio.sleep(0)
    assert (queue.running, queue.waiting) == (1, 2)
    with pytest.raises(Refused) as refused:
        await queue.enter()
    assert refused.value.code == "queue_full" and refused.value.retry_after >= 1
    first.release()
    first.release()  # idempotent: it hands on one slot, not two
    slot = await second
    assert order == ["second"] and (queue.running, queue.waiting) == (1, 1)
    slot.release()
    (await third).release()
    assert order == ["second", "third"] and (queue.running, queue.waiting) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_its_turn_passes_on():
    queue = AdmissionQueue(slots=1, max_queue=4, timeout=5)
    held = await queue.enter()
    leaving = asyncio.create_task(queue.enter())
    staying = asyncio.create_task(queue.enter())
    await asyncio.sleep(0)
    assert queue.waiting == 2
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert queue.waiting == 1  # left at once, not when its turn came
    held.release()
    slot = await staying
    assert queue.running == 1
    slot.release()
    assert queue.running == 0


async def test_a_wait_beyond_the_timeout_is_refused_and_a_drain_refuses_everyone_waiting():
    waits, refusals = [], []
    queue = AdmissionQueue(slots=1, max_queue=4, timeout=0.1, on_wait=waits.append, on_refuse=refusals.append)
    held = await queue.enter()
    with pytest.raises(Refused) as refused:
        await queue.enter()
    assert refused.value.code == "queue_timeout" and queue.waiting == 0
    waiting = asyncio.create_task(queue.enter())
    await asyncio.sleep(0)
    queue.drain()
    with pytest.raises(Refused) as refused:
        await waiting
    assert refused.value.code == "shutting_down"
    with pytest.raises(Refused):
        await queue.enter()
    held.release()
    assert queue.running == 0 and waits == [0.0]
    assert refusals == ["queue_timeout", "shutting_down", "shutting_down"]


async def test_a_slot_handed_over_just_as_its_waiter_is_cancelled_is_passed_on():
    queue = AdmissionQueue(slots=1, max_queue=4, timeout=5)
    held = await queue.enter()
    unlucky = asyncio.create_task(queue.enter())
    next_one = asyncio.create_task(queue.enter())
    await asyncio.sleep(0)
    held.release()  # hands the slot to `unlucky` ...
    unlucky.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await unlucky
    slot = await asyncio.wait_for(next_one, 1)
    assert queue.running == 1
    slot.release()
    assert (queue.running, queue.waiting) == (0, 0)
