"""SessionCacheStore: the seed's unit tests as written, plus the byte budget."""

import pytest

from meshws.model.kv.cache_store import CacheBudgetExceeded, KVCacheMiss, SessionCacheStore


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_lookup_roundtrip_advances_lru():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0, clock=_Clock())
    store.store("s1", cache=object(), seq_len=6, effective_start=12)
    entry = store.lookup("s1", expected_seq_len=6, effective_start=12)
    assert entry.seq_len == 6
    entry.seq_len += 1
    assert store.lookup("s1", expected_seq_len=7).seq_len == 7


def test_lookup_unknown_session_raises_cache_miss():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0)
    with pytest.raises(KVCacheMiss):
        store.lookup("nope")


def test_seq_len_mismatch_drops_entry_and_raises():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0)
    store.store("s1", cache=object(), seq_len=6, effective_start=0)
    with pytest.raises(KVCacheMiss):
        store.lookup("s1", expected_seq_len=9)
    # Entry must be gone — a poisoned cache is never reused.
    with pytest.raises(KVCacheMiss):
        store.lookup("s1")


def test_effective_start_mismatch_raises():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0)
    store.store("s1", cache=object(), seq_len=6, effective_start=12)
    with pytest.raises(KVCacheMiss):
        store.lookup("s1", effective_start=21)


def test_ttl_expiry_evicts_stale_sessions():
    clock = _Clock()
    store = SessionCacheStore(max_sessions=4, ttl_seconds=60.0, clock=clock)
    store.store("s1", cache=object(), seq_len=6, effective_start=0)
    clock.now = 61.0
    with pytest.raises(KVCacheMiss):
        store.lookup("s1")
    assert len(store) == 0


def test_lru_eviction_bounds_session_count():
    clock = _Clock()
    store = SessionCacheStore(max_sessions=2, ttl_seconds=1000.0, clock=clock)
    store.store("s1", cache=object(), seq_len=1, effective_start=0)
    store.store("s2", cache=object(), seq_len=1, effective_start=0)
    store.lookup("s1")  # s1 becomes most recent → s2 is LRU
    store.store("s3", cache=object(), seq_len=1, effective_start=0)
    assert len(store) == 2
    with pytest.raises(KVCacheMiss):
        store.lookup("s2")
    store.lookup("s1")
    store.lookup("s3")


def test_drop_removes_session():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0)
    store.store("s1", cache=object(), seq_len=1, effective_start=0)
    store.drop("s1")
    with pytest.raises(KVCacheMiss):
        store.lookup("s1")


# -- byte budget ------------------------------------------------------------


def test_byte_budget_evicts_least_recently_used():
    store = SessionCacheStore(max_sessions=10, ttl_seconds=100.0, max_bytes=1000)
    store.store("s1", cache=object(), seq_len=1, effective_start=0, nbytes=400)
    store.store("s2", cache=object(), seq_len=1, effective_start=0, nbytes=400)
    store.lookup("s1")  # s2 is now the least recent
    store.store("s3", cache=object(), seq_len=1, effective_start=0, nbytes=400)
    assert sorted(store.session_ids()) == ["s1", "s3"]
    assert store.total_bytes == 800


def test_growing_session_evicts_others_to_stay_under_budget():
    store = SessionCacheStore(max_sessions=10, ttl_seconds=100.0, max_bytes=1000)
    store.store("old", cache=object(), seq_len=1, effective_start=0, nbytes=300)
    store.store("live", cache=object(), seq_len=1, effective_start=0, nbytes=300)
    store.resize("live", 800)
    assert store.session_ids() == ["live"]
    assert store.total_bytes == 800


def test_session_larger_than_budget_is_refused_and_dropped():
    store = SessionCacheStore(max_sessions=10, ttl_seconds=100.0, max_bytes=1000)
    with pytest.raises(CacheBudgetExceeded):
        store.store("huge", cache=object(), seq_len=1, effective_start=0, nbytes=1001)
    store.store("s1", cache=object(), seq_len=1, effective_start=0, nbytes=900)
    with pytest.raises(CacheBudgetExceeded):
        store.resize("s1", 1200)
    assert len(store) == 0
    assert store.total_bytes == 0


def test_purge_expired_counts_removed_sessions():
    clock = _Clock()
    store = SessionCacheStore(max_sessions=4, ttl_seconds=10.0, clock=clock)
    store.store("s1", cache=object(), seq_len=1, effective_start=0, nbytes=5)
    clock.now = 5.0
    store.store("s2", cache=object(), seq_len=1, effective_start=0, nbytes=5)
    clock.now = 12.0
    assert store.purge_expired() == 1
    assert store.session_ids() == ["s2"]


def test_the_default_cache_budget_is_half_the_memory_free_capped_by_the_cgroup(tmp_path):
    from meshws.model.memory import MIN_CACHE_BUDGET, available_memory, default_cache_budget

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(str(meminfo), str(cgroup)) == 4000000 * 1024  # no cgroup files: the machine's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("100\n")
    assert available_memory(str(meminfo), str(cgroup)) == 4000000 * 1024  # an unlimited cgroup
    (cgroup / "memory.max").write_text(str(3 * 2**30))
    (cgroup / "memory.current").write_text(str(2**30))
    assert available_memory(str(meminfo), str(cgroup)) == 2 * 2**30  # the cgroup has less room
    assert default_cache_budget(2 * 2**30) == 2**30
    assert default_cache_budget(1000) == MIN_CACHE_BUDGET
    assert available_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_under_pressure_an_idle_kept_session_goes_before_a_live_one():
    """A conversation kept warm between answers is idle; a generating session is touched every step."""
    clock = _Clock()
    store = SessionCacheStore(max_sessions=8, ttl_seconds=600.0, clock=clock, max_bytes=300)
    store.store("warm", cache=object(), seq_len=10, effective_start=0, nbytes=100)  # its answer ended
    clock.now += 1
    store.store("live", cache=object(), seq_len=10, effective_start=0, nbytes=100)
    for step in range(5):  # the live session decodes; the warm one waits for its next turn
        clock.now += 1
        store.lookup("live", expected_seq_len=10 + step).seq_len += 1
    store.store("new", cache=object(), seq_len=10, effective_start=0, nbytes=150)  # over the budget
    assert "warm" not in store and "live" in store and "new" in store


def test_a_longer_cache_is_returned_for_cutting_back_only_when_asked():
    store = SessionCacheStore(max_sessions=4, ttl_seconds=100.0)
    store.store("s", cache=object(), seq_len=9, effective_start=0)
    assert store.lookup("s", expected_seq_len=5, longer_ok=True).seq_len == 9
    with pytest.raises(KVCacheMiss):
        store.lookup("s", expected_seq_len=12, longer_ok=True)  # shorter than asked: a miss, and dropped
    assert "s" not in store


def test_the_last_session_going_gives_its_memory_back_once_its_cache_is_freed():
    import weakref

    class Cache:  # (a weak reference tells whether the store still holds it when the call comes)
        pass

    clock, calls = _Clock(), []
    store = SessionCacheStore(max_sessions=4, ttl_seconds=10.0, clock=clock,
                              emptied=lambda: calls.append((len(store.session_ids()), freed())))
    caches = [Cache(), Cache()]
    refs = [weakref.ref(cache) for cache in caches]

    def freed():
        return all(ref() is None for ref in refs)

    store.store("a", cache=caches[0], seq_len=1, effective_start=0)
    store.store("b", cache=caches[1], seq_len=1, effective_start=0)
    del caches
    assert store.drop("a") and calls == []  # "b" is still here
    assert not store.drop("a") and calls == []
    assert store.drop("b") and calls == [(0, True)]  # empty, every cache freed before the call
    store.store("c", cache=object(), seq_len=1, effective_start=0)
    clock.now = 11.0
    assert store.purge_expired() == 1 and calls == [(0, True)] * 2
    assert store.clear() == 0 and len(calls) == 2  # nothing went: no call
    store.store("d", cache=object(), seq_len=1, effective_start=0)
    assert store.clear() == 1 and len(calls) == 3
    store.store("e", cache=object(), seq_len=1, effective_start=0)  # a client that vanished: its session
    clock.now = 30.0  # expires, found so by whatever looks next
    with pytest.raises(KVCacheMiss):
        store.lookup("e")
    assert calls[3:] == [(0, True)]
    store.store("f", cache=object(), seq_len=2, effective_start=0)
    with pytest.raises(KVCacheMiss):  # a mismatched entry is dropped: the store is empty again
        store.lookup("f", expected_seq_len=5)
    assert len(calls) == 5 and len(store) == 0 and len(calls) == 5


def test_a_private_session_is_not_counted_and_never_evicts_a_users():
    store = SessionCacheStore(max_sessions=2, ttl_seconds=10.0, clock=_Clock(), max_bytes=100)
    store.store("a", cache=object(), seq_len=1, effective_start=0, nbytes=60)
    store.store("b", cache=object(), seq_len=1, effective_start=0, nbytes=40)
    with store.private("probe"):
        store.store("probe", cache=object(), seq_len=1, effective_start=0, nbytes=30)  # over both limits if counted
        store.resize("probe", 50)
        assert "probe" in store and store.lookup("probe").nbytes == 50
        assert len(store) == 2 and store.total_bytes == 100 and store.session_ids() == ["a", "b"]
        assert store.evictions == 0
        store.store("c", cache=object(), seq_len=1, effective_start=0, nbytes=10)  # a user's: the LRU user goes
        assert store.session_ids() == ["b", "c"] and "probe" in store
    assert "probe" not in store and len(store) == 2 and store.total_bytes == 50


def test_a_private_session_alone_does_not_make_the_store_look_occupied():
    calls = []
    store = SessionCacheStore(max_sessions=4, ttl_seconds=10.0, clock=_Clock(), emptied=lambda: calls.append(1))
    store.store("a", cache=object(), seq_len=1, effective_start=0)
    with store.private("probe"):
        store.store("probe", cache=object(), seq_len=1, effective_start=0)
        assert store.drop("a") and calls == [1]  # the last user's session went: memory goes back
    assert calls == [1] and len(store) == 0


def test_shared_blocks_count_once_in_the_totals_and_the_budget():
    import torch

    from meshws.model.kv.kv_blocks import KV_BLOCK, LeanCache, footprint

    def cache(blocks):
        made = LeanCache(2, 1, 4, torch.float32)
        made.reserve(blocks * KV_BLOCK)
        made.length = blocks * KV_BLOCK
        return made

    block = 2 * 2 * KV_BLOCK * 4 * 4  # layers x (keys, values) x positions x dim x fp32
    prefix = cache(4)
    store = SessionCacheStore(max_sessions=8, ttl_seconds=100.0, max_bytes=7 * block, footprint=footprint)
    store.store("prefix", prefix, prefix.length, 0, nbytes=prefix.nbytes)
    forks = [prefix.copy(prefix.length) for _ in range(3)]
    for index, fork in enumerate(forks):
        fork.reserve(fork.length + 1)  # one block of its own each
        store.store(f"s{index}", fork, fork.length, 0, nbytes=fork.nbytes)
    assert store.total_bytes == 7 * block and len(store) == 4  # 4 shared + 3 own: within the budget, none evicted
    assert sum(fork.nbytes for fork in forks) + prefix.nbytes == 19 * block  # (each cache counts all it reads)
    late = prefix.copy(prefix.length)
    late.reserve(late.length + 1)
    store.store("late", late, late.length, 0, nbytes=late.nbytes)
    # The prefix went first and freed nothing (its forks still read its blocks): then s0, whose own block it was.
    assert "prefix" not in store and "s0" not in store and {"s1", "s2", "late"} <= set(store.session_ids())
    assert store.total_bytes == 7 * block
    assert [b.holders for b in prefix.blocks] == [3, 3, 3, 3]
    for sid in ("s1", "s2", "late"):
        store.drop(sid)
    assert store.total_bytes == 0 and all(b.holders == 0 for b in prefix.blocks)


def test_a_kept_prefix_is_counted_apart_from_the_sessions_but_in_the_bytes():
    calls = []
    store = SessionCacheStore(max_sessions=1, ttl_seconds=100.0, emptied=lambda: calls.append(len(store)))
    store.keep_apart("prefix")
    store.store("prefix", object(), 64, 0, nbytes=100)
    store.store("user", object(), 70, 0, nbytes=10)
    assert len(store) == 1 and store.prefixes == 1 and store.total_bytes == 110  # (the cap counts users only)
    store.drop("prefix")
    assert store.prefixes == 0 and store.total_bytes == 10 and calls == []  # (a user's session is here)
    store.keep_apart("later")
    store.store("later", object(), 64, 0, nbytes=100)
    store.drop("user")
    assert calls == [0], "the users' last session went: memory goes back, a prefix kept or not"
    store.drop("later")
    assert calls == [0, 0] and store.total_bytes == 0, "and again when the last kept prefix goes"
