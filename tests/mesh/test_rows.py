"""A link's outbox of decode rows: a wave's rows leave as one frame, in order, and a failure reaches every row."""

import asyncio

import pytest

from meshws.mesh.link import LinkDown
from meshws.mesh.rows import RowOutbox, travels_in_waves
from meshws.mesh.wire import DecodeRow, decode_rows, read_forward_headers


def _row(sid, group=1):
    return DecodeRow(sid, 5, 9, bytes(16), group)


async def test_rows_handed_over_in_one_turn_leave_as_one_frame_and_a_lone_row_as_a_plain_one():
    sent = []

    async def send(data):
        sent.append(data)

    outbox = RowOutbox(send)
    sizes = await asyncio.gather(*(outbox.add(_row(f"s{i}"), 8, "bfloat16", 1 << 16) for i in range(5)))
    assert len(sent) == 1 and [frame.sid for frame in decode_rows(sent[0])] == [f"s{i}" for i in range(5)]
    assert sizes == [len(sent[0]) // 5] * 5 and (outbox.frames, outbox.rows) == (1, 5)
    await outbox.add(_row("alone"), 8, "bfloat16", 1 << 16)
    assert read_forward_headers(sent[1])[0].rows == 1 and b'"rows"' not in sent[1]  # the frame it always was
    wide = [outbox.add(_row(f"w{i}"), 8, "bfloat16", 1 << 16) for i in range(2)]
    other = outbox.add(DecodeRow("f", 5, 9, bytes(32)), 8, "float32", 1 << 16)
    await asyncio.gather(*wide, other)
    assert [[f.dtype for f in decode_rows(data)] for data in sent[2:]] == [["bfloat16"] * 2, ["float32"]]


async def test_a_waves_rows_coming_over_several_turns_still_share_a_frame():
    sent = []

    async def send(data):
        sent.append(data)

    outbox = RowOutbox(send)

    async def late(index):
        for _ in range(index):  # (each a turn of the event loop later than the one before)
            await asyncio.sleep(0)
        await outbox.add(_row(f"s{index}", group=3), 8, "bfloat16", 1 << 16)

    await asyncio.gather(*(late(index) for index in range(3)))
    assert [len(decode_rows(data)) for data in sent] == [3]


async def test_a_control_frame_never_overtakes_rows_handed_over_before_it():
    sent = []

    async def send(data):
        sent.append(data)

    outbox = RowOutbox(send)
    rows = [outbox.add(_row(f"s{i}"), 8, "bfloat16", 1 << 16) for i in range(2)]
    await outbox.flush()  # what `Link.send_control` does before its frame
    sent.append("close")
    await asyncio.gather(*rows)
    assert len(sent) == 2 and sent[1] == "close" and len(decode_rows(sent[0])) == 2


async def test_a_link_that_fails_fails_every_row_waiting_on_it():
    async def send(data):
        raise LinkDown("link to ws://x is down")

    outbox = RowOutbox(send)
    results = await asyncio.gather(*(outbox.add(_row(f"s{i}"), 8, "bfloat16", 1 << 16) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(result, LinkDown) for result in results)


@pytest.mark.parametrize("mode, shape, ids, drafts, rides", [
    ("decode", [1, 1, 8], None, (), True),
    ("prefill", [1, 1, 8], None, (), False),
    ("decode", [1, 3, 8], None, (), False),  # drafts to verify: positions of one session
    ("decode", [1, 1, 8], [1, 2], (), False),
    ("decode", [1, 2, 8], None, (7,), False),
])
def test_only_plain_one_position_decode_steps_travel_in_waves(mode, shape, ids, drafts, rides):
    assert travels_in_waves(mode, shape, ids, drafts) is rides


async def test_a_row_computed_alone_goes_at_once_as_a_plain_frame():
    sent = []

    async def send(data):
        sent.append(data)

    outbox = RowOutbox(send)
    size = await outbox.send(_row("alone"), 8, "bfloat16", 1 << 16)  # (no turn waited: nothing else to meet)
    assert len(sent) == 1 and size == len(sent[0]) and b'"rows"' not in sent[0]
    await asyncio.gather(*(outbox.send(_row(f"s{i}", group=2), 8, "bfloat16", 1 << 16) for i in range(2)))
    assert len(decode_rows(sent[1])) == 2


async def test_a_sender_cancelled_mid_flush_leaves_no_row_unsent():
    gate, sent = asyncio.Event(), []

    async def send(data):
        await gate.wait()
        sent.append(data)

    outbox = RowOutbox(send)
    rows = [outbox.add(_row(f"s{i}"), 8, "bfloat16", 1 << 16) for i in range(2)]
    caller = asyncio.create_task(outbox.flush())  # (a control frame's sender, cancelled while the rows go)
    await asyncio.sleep(0)
    caller.cancel()
    gate.set()
    await asyncio.wait_for(asyncio.gather(*rows), 5)
    assert len(decode_rows(sent[0])) == 2
