"""A node of a model of the size people split maps its own tensors only: a half of a synthetic Llama-3.2-1B.

Each node runs in a fresh process with an empty cache (`memory_bench`), as on a new machine: it writes no
weights (its tokenizer, on a head: under 2 % of the file), and after a prompt its resident weight pages
(`/proc/self/smaps` of the file's mapping) are its tensors' bytes, not the file's.
"""

import pytest

from meshws.tools.memory_bench import run_probe
from meshws.tools.synth_gguf import write

pytestmark = [pytest.mark.real_model, pytest.mark.processes]
MIB = 2**20


@pytest.fixture(scope="module")
def one_b(tmp_path_factory):
    return write(str(tmp_path_factory.mktemp("synthetic-1b") / "synth-1b.gguf"), "1b")


@pytest.mark.parametrize("span", [(0, 8), (8, 16)], ids=["head", "tail"])
def test_a_half_node_of_a_1b_model_maps_only_its_share(one_b, span):
    from meshws.model.gguf.gguf_file import read_table

    table = read_table(one_b)
    first, last = span
    mine = sum(entry.nbytes for name, entry in table.tensors.items()
               if (name.startswith("blk.") and first <= int(name.split(".")[1]) < last)
               or (first == 0 and name == "token_embd.weight")
               or (last == 16 and name in ("output.weight", "output_norm.weight")))
    whole = sum(entry.nbytes for entry in table.tensors.values())
    report = run_probe(one_b, span, "auto")
    assert report["weight_bytes"] == mine < 0.6 * whole
    # Resident: the tensors a prompt reads (a head's embeddings only at the prompt's rows), with a page or two of
    # slack where a tensor's neighbours share its first and last pages (and the kernel maps pages around a fault).
    assert report["weights_resident_bytes"] <= mine + 4 * MIB
    assert report["weights_resident_bytes"] >= (mine - (table.tensors["token_embd.weight"].nbytes if first == 0 else 0)
                                                 ) * 0.95
    assert report["cache_written_bytes"] < 0.02 * table.path.stat().st_size
    assert report["peak_bytes"] < mine + 700 * MIB  # the runtime (torch, a head's tokenizer) and a prompt's buffers
