"""A node's speed probe runs on a session no user sees: not in its count, and never evicting theirs."""

import pytest

from meshws.model.shard import ModelShard, ShardSettings
from meshws.model.speed import probe

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("span", [(0, 4), (26, 30)])
def test_a_probe_neither_shows_as_a_session_nor_evicts_one(embedded_model, span):
    shard = ModelShard(embedded_model, *span, ShardSettings(dtype="float32", max_sessions=1))
    seen = []
    real_store = shard.sessions.store

    def store(session_id, *args, **kwargs):  # what /health would count while the probe holds its cache
        entry = real_store(session_id, *args, **kwargs)
        seen.append((len(shard.sessions), shard.sessions.total_bytes, tuple(shard.sessions.session_ids())))
        return entry

    if shard.is_head:
        shard.encode_prompt([1, 2, 3], "user")
    else:
        shard.forward_bytes(bytes(4 * 3 * shard.hidden_size), (1, 3, shard.hidden_size), dtype="float32",
                            session_id="user", cache_mode="prefill", past_len=0)
    held = shard.sessions.total_bytes
    shard.sessions.store = store
    step_seconds, _ = probe(shard, min_seconds=0.0)
    assert step_seconds > 0 and seen  # it ran, storing its cache at least once
    assert set(seen) == {(1, held, ("user",))}  # at the cap of one session, the user's stayed and stood alone
    assert shard.sessions.session_ids() == ["user"] and shard.sessions.held("user") == 3
