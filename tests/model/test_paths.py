"""A node times the kernels' two paths for a few rows of a 32-value block type and keeps the faster (`paths`).

The choice may differ from machine to machine and minute to minute; the bits may not: every row count gives the
same result on either path, and the node's choice is what the library then runs and /health reports.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from meshws.model.kernels import native
from meshws.model.gguf.block_types import BlockTensor
from meshws.model.kernels.paths import choose_paths, direct_rows, typical_weights

KERNELS = native.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: meshws's kernels cannot be built")


def _weight(type_id, rows, columns, name="w", seed=0):
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    raw = quantize(values, GGMLQuantizationType(type_id))
    return BlockTensor(name, type_id, (rows, columns), torch.from_numpy(np.ascontiguousarray(raw)))


@pytest.fixture
def restored():
    """The library's choice is the process's: start with nothing measured (shards loaded by other tests may have
    timed these shapes already), then put back what other tests run with."""
    before, measured = dict(KERNELS.direct_rows), dict(KERNELS.measured_paths)
    KERNELS.measured_paths.clear()
    yield
    for type_id in KERNELS.direct_types:
        KERNELS.set_direct_rows(type_id, before[type_id])
    KERNELS.measured_paths.clear()
    KERNELS.measured_paths.update(measured)


def test_the_direct_path_keeps_the_rows_it_won_from_one_row_up():
    assert direct_rows({1: (30, 33), 2: (54, 38), 3: (69, 50)}) == 1
    assert direct_rows({1: (30, 40), 2: (40, 50), 3: (50, 45), 4: (50, 60)}) == 2  # (a later win is noise)
    assert direct_rows({1: (40, 30), 2: (20, 30)}) == 0
    assert direct_rows({1: (10, 20), 2: (10, 20)}) == 2
    assert direct_rows({1: (10, 10)}) == 0  # a tie goes to the tiles
    assert direct_rows({2: (10, 20)}) == 0  # counted from one row


def test_a_type_is_timed_on_the_shape_that_holds_most_of_its_bytes():
    small, large = _weight(3, 64, 256, "small"), _weight(3, 32, 768, "large")  # two smalls outweigh it
    lm_head = _weight(8, 256, 256, "lm_head")
    k_type = BlockTensor("q4_k", 12, (4, 256), torch.zeros(4, 144, dtype=torch.uint8))
    chosen = typical_weights([small, _weight(3, 64, 256, "small again"), large, lm_head, k_type], [2, 3, 8])
    assert {type_id: weight.name for type_id, weight in chosen.items()} == {3: "small", 8: "lm_head"}


def test_a_node_times_both_paths_keeps_the_faster_and_the_bits_never_move(restored):
    q4_1, q8_0 = _weight(3, 1536, 576, "ffn_up", 1), _weight(8, 800, 576, "lm_head", 2)
    q5_0 = _weight(6, 64, 576, "tiles only", 3)
    rows = torch.randn(9, 576)
    before = {name: KERNELS.qlinear(rows, weight, None, 2, "tiles") for name, weight in
              (("Q4_1", q4_1), ("Q8_0", q8_0))}
    facts = choose_paths(KERNELS, [q4_1, q8_0, q5_0], threads=2)
    have = {KERNELS.block_types[type_id] for type_id in KERNELS.direct_types}  # (none without AVX-512 VNNI)
    assert set(facts) == {"Q4_1", "Q8_0"} & have  # (Q5_0 has tiles alone: nothing to choose)
    for name, weight in (("Q4_1", q4_1), ("Q8_0", q8_0)):
        for count in range(1, 10):  # either side of the choice, and either path forced: the same bits
            for path in ("chosen", "direct", "tiles"):
                assert torch.equal(KERNELS.qlinear(rows[:count], weight, None, 2, path), before[name][:count])
        if name not in facts:
            continue
        measured, type_id = facts[name], weight.type_id
        timings = {int(count): (pair["direct"], pair["tiles"]) for count, pair in measured["microseconds"].items()}
        assert sorted(timings) == [1, 2, 3, 4, 5, 6] and all(0 < t < 1e6 for pair in timings.values() for t in pair)
        assert measured["direct_rows"] == direct_rows(timings) == KERNELS.direct_rows[type_id]
        assert measured["weight"] == weight.name and measured["shape"] == list(weight.shape)
        paths = KERNELS.product_paths([type_id])[name]
        rows_direct = measured["direct_rows"]
        assert paths.startswith(f"1-{rows_direct} rows: straight from the blocks") if rows_direct else \
            paths.startswith("tiles")
    assert torch.equal(KERNELS.qlinear(rows, q5_0, None, 2, "direct"), KERNELS.qlinear(rows, q5_0, None, 2))
    if "Q4_1" in facts:
        assert KERNELS.measured_paths["Q4_1"] is facts["Q4_1"]
        again = choose_paths(KERNELS, [q4_1], threads=2)  # another shard of this process: not timed twice
        assert again["Q4_1"] is facts["Q4_1"]


def test_a_choice_outside_what_the_library_has_changes_nothing(restored):
    q5_1 = 7
    assert q5_1 not in KERNELS.direct_types and KERNELS.set_direct_rows(q5_1, 4) == 0
    for type_id in {2, 3, 8} - KERNELS.direct_types:  # (a build without AVX-512 VNNI: tiles only, for every type)
        assert KERNELS.set_direct_rows(type_id, 3) == 0
    for type_id in KERNELS.direct_types:
        before = KERNELS.direct_rows[type_id]
        assert KERNELS.set_direct_rows(type_id, -1) == before and KERNELS.set_direct_rows(type_id, 1000) == before
        assert KERNELS.set_direct_rows(type_id, 0) == 0 and KERNELS.set_direct_rows(type_id, 5) == 5
