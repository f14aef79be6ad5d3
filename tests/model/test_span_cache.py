"""The converted-model cache follows spans: a node converts only what its span lacks, and shares the rest.

The tests of this module share one empty cache (`empty_model`), in order: a tail converts
first (the config too), then nodes that overlap it.
"""

import json
import shutil
import threading

import pytest
import torch

from meshws.model.shard import ModelShard
from meshws.model.source import locate_model, model_cache
from meshws.model.span_cache import MANIFEST, ModelCache

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def empty_model(tmp_path_factory):
    """The embedded model with an empty cache of its own."""
    return locate_model(None, tmp_path_factory.mktemp("empty-cache"))


def _parts(folder, dtype="float32"):
    return {path.name.removesuffix(".safetensors") for path in (folder / dtype).glob("*.safetensors")}


def _stamps(folder):
    """Each tensor file's inode and mtime: a file rewritten (even renamed over) changes both."""
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in (folder / "float32").iterdir()}


def _layers(first, last):
    return {f"model.layers.{index}" for index in range(first, last)}


def test_a_tail_converts_only_its_span_and_an_overlapping_node_only_the_difference(empty_model, caplog):
    folder = empty_model.folder
    tail = ModelShard(empty_model, 20, 30)
    # Ten layers, the final norm and the tied embedding matrix as LM head; no other layer, no tokenizer.
    assert _parts(folder) == _layers(20, 30) | {"model.norm", "model.embed_tokens"}
    assert not (folder / "tokenizer.json").exists() and not (folder / "bfloat16").exists()
    before = _stamps(folder)

    with caplog.at_level("INFO", logger="meshws.model"):
        middle = ModelShard(empty_model, 15, 25)
    assert _parts(folder) == _layers(15, 30) | {"model.norm", "model.embed_tokens"}
    assert "converted 5 float32 tensor parts" in caplog.text
    after = _stamps(folder)
    assert all(after[name] == stamp for name, stamp in before.items()), "shared files were rewritten"
    # Layers 20-24 are one file each, read by both shards (and packed by each for the lean path).
    assert torch.equal(middle.lean.layers[5].gate_up[0], tail.lean.layers[0].gate_up[0])


def test_nodes_started_together_convert_each_part_once(empty_model):
    caches = [model_cache(empty_model), model_cache(empty_model)]
    missing = {key for key in caches[0].span_parts("float32:0:4") if caches[0].problem(key)}
    assert missing == {f"float32/{part}" for part in _layers(0, 4)}  # the embeddings came with the tail
    errors = []

    def start(cache):
        try:
            cache.prepare_span(0, 4, "float32", tokenizer=False)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(cache,)) for cache in caches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors
    built = caches[0].converted + caches[1].converted
    assert sorted(built) == sorted(missing), "each part converted exactly once, by one node or the other"


def test_a_damaged_part_is_rebuilt_and_the_others_are_reused(empty_model, caplog):
    folder = empty_model.folder
    damaged = folder / "float32" / "model.layers.25.safetensors"
    size = damaged.stat().st_size
    with damaged.open("r+b") as handle:  # a crash mid-write: the file is cut short
        handle.truncate(size // 2)
    # Even a manifest that agrees with the damage does not fool the header check.
    manifest = json.loads((folder / MANIFEST).read_text())
    stat = damaged.stat()
    manifest["parts"]["float32/model.layers.25"][damaged.relative_to(folder).as_posix()] = {
        "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    cache = model_cache(empty_model)
    assert "does not match the file size" in cache.problem("float32/model.layers.25")
    before = _stamps(folder)

    with caplog.at_level("INFO", logger="meshws.model"):
        ModelShard(empty_model, 20, 30)
    assert "rebuilding" in caplog.text and "converted 1 float32 tensor parts" in caplog.text
    assert damaged.stat().st_size == size and cache.problem("float32/model.layers.25") is None
    after = _stamps(folder)
    assert {name for name in before if after[name] != before[name]} == {damaged.name}


def test_the_manifest_catches_changed_files_and_a_damaged_manifest(empty_model, tmp_path):
    for name in ("config.json", "generation_config.json", "meshws-tensors.json", MANIFEST):
        shutil.copy2(empty_model.folder / name, tmp_path / name)  # keeps mtimes
    cache = ModelCache(empty_model.gguf, tmp_path)
    assert cache.problem("config") is None
    assert cache.problem("float32/model.layers.25") == "float32/model.layers.25.safetensors is missing"
    assert cache.problem("tokenizer") == "missing"
    with (tmp_path / "config.json").open("a") as handle:
        handle.write(" ")
    assert cache.problem("config") == "config.json changed since conversion"
    (tmp_path / MANIFEST).write_text("{")
    assert "no readable manifest" in cache.problem("config")


def test_the_conversion_equals_transformers_own_gguf_loading(embedded_model, reference_model):
    """Part by part, the cache holds exactly what transformers' GGUF loader makes of the file.

    `load_gguf_checkpoint` is what `from_pretrained(..., gguf_file=...)` runs for this
    architecture: its tensors become the state dict, its config dict the config.
    """
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    theirs = load_gguf_checkpoint(str(embedded_model.gguf), return_tensors=True, model_to_load=reference_model,
                                  torch_dtype=torch.float32)
    ours = reference_model.state_dict()
    assert set(ours) - set(theirs["tensors"]) == {"lm_head.weight"}  # tied to the embeddings
    assert [name for name, tensor in theirs["tensors"].items() if not torch.equal(ours[name], tensor)] == []
    expected = AutoConfig.for_model(**theirs["config"]).to_dict()
    saved = AutoConfig.from_pretrained(str(embedded_model.folder)).to_dict()
    # What saving the loaded model adds: its class, its dtype, where it was saved.
    assert {key for key in expected.keys() | saved.keys() if expected.get(key) != saved.get(key)} == {
        "architectures", "dtype", "_name_or_path"}
    assert saved["architectures"] == [type(reference_model).__name__]
