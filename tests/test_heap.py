"""The heap a node freezes once loaded, and the collector's pauses it counts after (`meshws.heap`)."""

import gc

from meshws import heap


def test_freeze_leaves_live_objects_out_of_collections_and_counts_the_pauses():
    kept = [{"layer": index} for index in range(5000)]  # long-lived, like a loaded model's objects
    try:
        frozen = heap.freeze()
        # (a frozen object that dies leaves the count, and other threads' garbage may: at most what was frozen)
        assert len(kept) <= gc.get_freeze_count() <= frozen
        before = heap.describe()
        cycle: list = []
        cycle.append(cycle)  # garbage made after the freeze is still collected
        del cycle
        assert gc.collect() >= 1
        after = heap.describe()
        assert len(kept) <= after["frozen_objects"] <= frozen
        assert after["collections"][2] == before["collections"][2] + 1
        assert after["collection_seconds"][2] > before["collection_seconds"][2]
    finally:
        gc.unfreeze()
        if heap._on_collect in gc.callbacks:
            gc.callbacks.remove(heap._on_collect)
