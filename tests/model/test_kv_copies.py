"""A standby's copy of a session: rows exported as stored, imported on another shard, the same next tokens.

Real model, two full shards of the embedded model in one process (the serving node and its standby), for each kind
of KV cache; rows cross as `KVRows` bytes, as a standby frame carries them.
"""

import pytest

from meshws.model.backend import KVRows
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = pytest.mark.real_model

PROMPT = list(range(300, 300 + 333))  # more than a block of 256 positions


def _copy(source: ModelShard, standby: ModelShard, sid: str, sent: int, most: int = 100) -> int:
    """Send what the standby lacks in frames of `most` positions, as a feed does; the positions it then holds."""
    while True:
        rows = source.export_kv(sid, sent, most, 1 << 30)
        assert rows is not None
        if rows.count == 0:
            return sent
        rows = KVRows(rows.start, rows.dtype, rows.shape, bytes(rows.body))  # (bytes, as off the wire)
        sent = standby.import_kv(sid, rows)
        assert sent == rows.start + rows.count


def _tokens(shard: ModelShard, sid: str, token: int, at: int, count: int = 6) -> list[int]:
    out = []
    for step in range(count):
        token = shard.run_tokens([token], sid, "decode", at + step).token_id
        out.append(token)
    return out


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "q8_0"])
def test_a_standby_copy_answers_as_the_session_would(embedded_model, kv):
    settings = ShardSettings(dtype="float32", kv_dtype=kv)
    serving, standby = ModelShard(embedded_model, 0, 30, settings), ModelShard(embedded_model, 0, 30, settings)
    first = serving.encode_prompt(PROMPT, session_id="s").token_id
    held = _copy(serving, standby, "s", 0)
    assert held == len(PROMPT)
    assert standby.sessions.apart("standby") == 1 and len(standby.sessions) == 0  # counted apart until adopted
    assert standby.sessions.adopt("s") and len(standby.sessions) == 1
    assert _tokens(standby, "s", first, len(PROMPT)) == _tokens(serving, "s", first, len(PROMPT))
    serving.release_session("s"), standby.release_session("s")
    assert standby.sessions.total_bytes == 0


def test_a_cache_cut_back_is_sent_again_from_the_cut(embedded_model):
    settings = ShardSettings(dtype="float32", kv_dtype="bfloat16")
    serving, standby = ModelShard(embedded_model, 0, 30, settings), ModelShard(embedded_model, 0, 30, settings)
    first = serving.encode_prompt(PROMPT, session_id="s").token_id
    sent = _copy(serving, standby, "s", 0)
    _tokens(serving, "s", first, len(PROMPT), 3)
    sent = _copy(serving, standby, "s", sent)
    assert sent == len(PROMPT) + 3
    other = serving.run_tokens([7], "s", "decode", len(PROMPT) - 5).token_id  # cut back 8 positions, one written
    rows = serving.export_kv("s", sent, 100, 1 << 30)
    assert (rows.start, rows.count) == (len(PROMPT) - 5, 1)  # from the cut, though the standby held more
    standby.import_kv("s", rows)
    standby.sessions.adopt("s")
    assert _tokens(standby, "s", other, len(PROMPT) - 4) == _tokens(serving, "s", other, len(PROMPT) - 4)


def test_rows_that_do_not_fit_are_refused_and_a_gap_asks_for_earlier_rows(embedded_model):
    serving = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", kv_dtype="bfloat16"))
    other_kind = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", kv_dtype="float32"))
    serving.encode_prompt(PROMPT, session_id="s")
    rows = serving.export_kv("s", 0, 50, 1 << 30)
    with pytest.raises(ValueError, match="do not fit"):
        other_kind.import_kv("s", rows)
    later = serving.export_kv("s", 50, 50, 1 << 30)
    assert later.start == 50 and other_kind.sessions.total_bytes == 0
    standby = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", kv_dtype="bfloat16"))
    assert standby.import_kv("s", later) == 0  # no copy yet: the sender starts again from 0
    assert standby.import_kv("s", rows) == 50 and standby.import_kv("s", later) == 100
    short = KVRows(rows.start, rows.dtype, rows.shape, rows.body[:-2])
    with pytest.raises(ValueError, match="do not fill"):
        standby.import_kv("s", short)


def test_frames_fit_a_byte_limit_and_the_report_never_counts_rows_cut_since(embedded_model):
    serving = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", kv_dtype="bfloat16"))
    serving.encode_prompt(PROMPT, session_id="s")
    one = serving.export_kv("s", 0, 256, 0)  # (a limit below one position's bytes: one position still goes)
    per_position = len(one.body)
    assert one.count == 1 and serving.export_kv("s", 1, 256, 10 * per_position).count == 10
    serving.export_kv("s", 11, 1000, 1 << 30)
    assert serving.kv_unchanged("s") == len(PROMPT)  # all of it exported as it is
    serving.run_tokens([7], "s", "decode", 200)  # a cut back to 200, and one position written
    assert serving.kv_unchanged("s") == 200  # a standby's copy still matches below the cut only
