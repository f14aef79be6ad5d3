"""A node's speed probe runs on a session no user sees: not in its count, and never evicting theirs."""

import time

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


def test_a_tails_time_choosing_its_token_counts_with_its_lm_head_not_its_layers(embedded_model, monkeypatch):
    """Placement weighs a tail's layers apart from its own per-token work; a token's choice (sampling, here slowed by
    100 ms a step) is that work, as its LM head is: left among the layers, it made a tail's layers measure 26 % slower
    than the same layers on a head, and the plan gave the tail too few. (The layers' time with the slow choice is
    compared with theirs without it, so a slow or busy host moves both.)"""
    from meshws.model import shard as shard_module

    shard = ModelShard(embedded_model, 26, 30, ShardSettings(dtype="float32"))
    choose = shard_module.verify_drafts
    step_seconds, lm_head_seconds = probe(shard, min_seconds=0.3)
    plain_layers = step_seconds - lm_head_seconds

    def slow_choice(*args, **kwargs):
        time.sleep(0.1)
        return choose(*args, **kwargs)

    monkeypatch.setattr(shard_module, "verify_drafts", slow_choice)
    step_seconds, lm_head_seconds = probe(shard, min_seconds=0.3)
    assert lm_head_seconds >= 0.1  # the choice is the tail's own work ...
    assert step_seconds - lm_head_seconds < plain_layers + 0.05  # ... not its layers'
