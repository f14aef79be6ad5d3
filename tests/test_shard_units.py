"""Shard behaviour that needs no model: the seed's stateless fallback, and sampling."""

import pytest
import torch

from meshws.cache_store import KVCacheMiss, SessionCacheStore
from meshws.sampling import SamplingParams, sample_token
from meshws.shard import ModelShard


def _fake_shard(fail_when_cached: bool):
    shard = object.__new__(ModelShard)
    shard.model_id = "fake-hybrid"
    shard.supports_kv_cache = True
    shard.sessions = SessionCacheStore()
    shard._effective_start = lambda start_layer=None: 22
    shard._new_session_cache = lambda: object()
    calls = []

    def fake_run_layers(hidden_states, attention_mask, position_ids, *, start_layer=None, cache=None, past_len=0):
        calls.append({"cache": cache, "past_len": past_len})
        if cache is not None and fail_when_cached:
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return "stateless-ok" if cache is None else "cached-ok"

    shard._run_layers = fake_run_layers
    return shard, calls


def test_prefill_cache_triton_cpu_failure_disables_cache_and_retries_stateless():
    """CPU shards must recover when hybrid model cache path dispatches Triton."""
    shard, calls = _fake_shard(fail_when_cached=True)
    result = ModelShard._run_layers_session(
        shard,
        hidden_states=object(),
        attention_mask=None,
        position_ids=None,
        session_id="session-1",
        cache_mode="prefill",
    )
    assert result == "stateless-ok"
    assert shard.supports_kv_cache is False
    assert len(calls) == 2
    assert calls[0]["cache"] is not None
    assert calls[1]["cache"] is None


def test_after_fallback_decode_steps_ask_for_reprefill_and_prefills_stay_stateless():
    shard, calls = _fake_shard(fail_when_cached=True)
    hidden = torch.zeros(1, 3, 4)
    ModelShard._run_layers_session(shard, hidden, None, None, session_id="s", cache_mode="prefill")
    # A decode step would run one token without its context: the head must re-prefill instead.
    with pytest.raises(KVCacheMiss):
        ModelShard._run_layers_session(shard, hidden[:, :1], None, None, session_id="s",
                                       cache_mode="decode", past_len=3)
    assert ModelShard._run_layers_session(shard, hidden, None, None, session_id="s",
                                          cache_mode="prefill") == "stateless-ok"
    assert all(call["cache"] is None for call in calls[1:])


def test_cached_prefill_stores_session_and_decode_advances_it():
    shard, calls = _fake_shard(fail_when_cached=False)
    hidden = torch.zeros(1, 5, 4)
    assert ModelShard._run_layers_session(shard, hidden, None, None, session_id="s", cache_mode="prefill") == "cached-ok"
    assert shard.sessions.lookup("s").seq_len == 5
    ModelShard._run_layers_session(shard, hidden[:, :1], None, None, session_id="s", cache_mode="decode", past_len=5)
    assert shard.sessions.lookup("s").seq_len == 6
    # A step that disagrees about past_len is a miss, and the poisoned entry is dropped.
    with pytest.raises(KVCacheMiss):
        ModelShard._run_layers_session(shard, hidden[:, :1], None, None, session_id="s", cache_mode="decode", past_len=9)
    assert "s" not in shard.sessions


# -- sampling -----------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(), position=0) == 1


def test_seeded_sampling_is_reproducible_per_position():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample_token(logits, params, position=p) for p in range(20)]
    again = [sample_token(logits, params, position=p) for p in range(20)]
    other = [sample_token(logits, SamplingParams(temperature=1.0, seed=43), position=p) for p in range(20)]
    assert first == again
    assert first != other


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.tensor([5.0, 4.9, 4.8, 0.0, -1.0])
    draws = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), position=0) for s in range(200)}
    assert draws == {0, 1}
    probs_first = torch.tensor([10.0, 0.0, 0.0, 0.0])
    draws = {sample_token(probs_first, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(50)}
    assert draws == {0}


def test_repetition_and_frequency_penalties_change_the_choice():
    logits = torch.tensor([2.0, 1.9, 0.0])
    assert sample_token(logits, SamplingParams(repetition_penalty=1.5), 3, history=[0, 2]) == 1
    assert sample_token(logits, SamplingParams(frequency_penalty=0.2), 3, history=[5, 0], generated_from=1) == 1
    # Prompt tokens do not count for the OpenAI-style penalties.
    assert sample_token(logits, SamplingParams(frequency_penalty=0.2), 3, history=[0, 1], generated_from=2) == 0


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"temperature": "hot"}, "number"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 1.5}, "number"),
        ({"volume": 11}, "unknown"),
        ("greedy", "object"),
    ],
)
def test_sampling_from_wire_rejects_bad_fields(data, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_wire(data)


def test_sampling_wire_round_trip():
    params = SamplingParams(temperature=0.7, top_k=40, seed=3)
    assert params.to_wire() == {"temperature": 0.7, "top_k": 40, "seed": 3}
    assert SamplingParams.from_wire(params.to_wire()) == params
