"""The cached path and the seed's stateless fallback, with layers faked (no model needed)."""

import pytest
import torch

from meshws.model.kv.cache_store import KVCacheMiss, SessionCacheStore
from meshws.model.session_layers import SessionLayers


def _layers(fail_when_cached: bool):
    calls = []

    def run(hidden, positions, cache):
        calls.append({"cache": cache})
        if cache is not None and fail_when_cached:
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return "stateless-ok" if cache is None else "cached-ok"

    return SessionLayers(run, new_cache=object, sessions=SessionCacheStore(), start=22, label="fake-hybrid"), calls


def test_prefill_cache_triton_cpu_failure_disables_cache_and_retries_stateless():
    """CPU shards must recover when hybrid model cache path dispatches Triton."""
    layers, calls = _layers(fail_when_cached=True)
    result = layers.run(torch.zeros(1, 3, 4), None, session_id="session-1", mode="prefill")
    assert result == "stateless-ok"
    assert layers.supports_kv_cache is False
    assert len(calls) == 2
    assert calls[0]["cache"] is not None
    assert calls[1]["cache"] is None


def test_after_fallback_decode_steps_ask_for_reprefill_and_prefills_stay_stateless():
    layers, calls = _layers(fail_when_cached=True)
    hidden = torch.zeros(1, 3, 4)
    layers.run(hidden, None, session_id="s", mode="prefill")
    # A decode step would run one token without its context: the head must re-prefill instead.
    with pytest.raises(KVCacheMiss):
        layers.run(hidden[:, :1], None, session_id="s", mode="decode", past_len=3)
    assert layers.run(hidden, None, session_id="s", mode="prefill") == "stateless-ok"
    assert all(call["cache"] is None for call in calls[1:])
    assert len(layers.sessions) == 0


def test_cached_prefill_stores_session_and_decode_advances_it():
    layers, calls = _layers(fail_when_cached=False)
    hidden = torch.zeros(1, 5, 4)
    assert layers.run(hidden, None, session_id="s", mode="prefill") == "cached-ok"
    assert layers.sessions.lookup("s").seq_len == 5
    layers.run(hidden[:, :1], None, session_id="s", mode="decode", past_len=5)
    assert layers.sessions.lookup("s").seq_len == 6
    # A step that disagrees about past_len is a miss, and the poisoned entry is dropped.
    with pytest.raises(KVCacheMiss):
        layers.run(hidden[:, :1], None, session_id="s", mode="decode", past_len=9)
    assert "s" not in layers.sessions
    # No session: stateless, and nothing is stored.
    assert layers.run(hidden, None) == "stateless-ok"
    assert len(layers.sessions) == 0
