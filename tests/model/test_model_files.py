"""A node writes only small files for a GGUF: the tokenizer (a head's), a transformers config (that path's only).

The tests of this module share one empty cache (`empty_model`), in order: a tail starts first.
"""

import logging
import os
import shutil
import threading

import pytest
import torch

from meshws.model.gguf.model_files import MANIFEST, ModelCache, stale_copies
from meshws.model.settings import ShardSettings
from meshws.model.shard import ModelShard
from meshws.model.source import embedded_gguf_path, locate_model, model_cache, resolve_model
from meshws.model.gguf.tokenizer_files import build_tokenizer

pytestmark = pytest.mark.real_model

TEXTS = ["Hello world, how are you?", "  leading spaces\n\ttabs and émojis 🎉 <|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x**2 # 1234567"]


@pytest.fixture(scope="module")
def empty_model(tmp_path_factory):
    """The embedded model with an empty cache of its own."""
    return locate_model(None, tmp_path_factory.mktemp("empty-cache"))


def _written(folder):
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


def test_a_tail_writes_nothing_and_a_head_only_its_tokenizer(empty_model):
    folder = empty_model.folder
    tail = ModelShard(empty_model, 20, 30)
    assert tail.compute_path.startswith("lean llama, GGUF blocks")
    assert not folder.exists() or not any(path.is_file() for path in folder.rglob("*"))
    ModelShard(empty_model, 0, 10)
    files = _written(folder)
    assert {"tokenizer.json", "tokenizer_config.json", MANIFEST} <= set(files)
    assert not any(name.endswith((".safetensors", "config.json")) and name != "tokenizer_config.json"
                   for name in files), "no weights and no transformers config"
    assert sum(files.values()) < 0.05 * empty_model.gguf.stat().st_size  # (a 1B file: < 2 %, test_gguf_memory)


def test_nodes_started_together_build_the_tokenizer_once(empty_model, tmp_path):
    shared = locate_model(None, tmp_path)
    caches = [model_cache(shared), model_cache(shared)]
    errors = []

    def start(cache):
        try:
            cache.prepare(["tokenizer"])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(cache,)) for cache in caches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors
    assert caches[0].converted + caches[1].converted == ["tokenizer"], "built once, by one node or the other"


def test_a_heads_tokenizer_built_early_in_a_child_is_the_one_built_in_process(tmp_path, caplog):
    early, here = locate_model(None, tmp_path / "early"), locate_model(None, tmp_path / "here")
    model_cache(early).build_early("tokenizer")  # as `python -m meshws.node --role head` does before torch imports
    model_cache(here).prepare(["tokenizer"])
    cache = model_cache(early)
    with caplog.at_level(logging.INFO, logger="meshws.model"):
        cache.prepare(["tokenizer"])
    assert "built tokenizer of SmolLM2-135M-Instruct.Q4_1.gguf in a child" in caplog.text and cache.converted == []
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (early.folder / name).read_bytes() == (here.folder / name).read_bytes(), name


def test_a_child_that_fails_leaves_the_build_to_the_node(tmp_path, caplog, monkeypatch):
    own = locate_model(None, tmp_path)
    monkeypatch.setattr("sys.executable", "/bin/false")
    model_cache(own).build_early("tokenizer")
    cache = model_cache(own)
    with caplog.at_level(logging.INFO, logger="meshws.model"):
        cache.prepare(["tokenizer"])
    assert "failed (exit 1); building it here" in caplog.text and cache.converted == ["tokenizer"]


def test_a_nodes_early_start_skips_flags_it_will_refuse_and_starts_a_heads_build(tmp_path, capsys):
    from meshws import early
    from meshws.model.gguf import model_files

    early.start(["--role", "nonsense"])
    early.start(["--role", "tail", "--layers", "20-29", "--cache-dir", str(tmp_path)])  # a tail needs no tokenizer
    assert capsys.readouterr() == ("", "") and not model_files._EARLY
    pipe = tmp_path / "secret-pipe"
    os.mkfifo(pipe)  # a secret the node reads once (opening it to read would wait here for a writer)
    reader = threading.Thread(target=early.start, args=(["--role", "tail", "--layers", "20-29", "--secret-file",
                                                          str(pipe), "--cache-dir", str(tmp_path)],), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with pipe.open("w") as writer:
            writer.write("x" * 32)
    assert not reader.is_alive(), "the early start read the secret file"
    early.start(["--role", "full", "--cache-dir", str(tmp_path)])
    assert [folder.parent for folder, _ in model_files._EARLY] == [tmp_path]
    model_cache(locate_model(None, tmp_path)).prepare(["tokenizer"])  # waits for the child
    assert not model_files._EARLY and (locate_model(None, tmp_path).folder / "tokenizer.json").is_file()


def test_a_damaged_tokenizer_is_rebuilt_and_the_manifest_catches_changes(empty_model, caplog):
    folder = empty_model.folder
    cache = model_cache(empty_model)
    assert cache.problem("tokenizer") is None
    with (folder / "tokenizer.json").open("a") as handle:
        handle.write(" ")
    assert cache.problem("tokenizer") == "tokenizer.json changed since conversion"
    with caplog.at_level("INFO", logger="meshws.model"):
        cache.prepare(["tokenizer"])
    assert "rebuilding" in caplog.text and cache.problem("tokenizer") is None
    (folder / MANIFEST).write_text("{")
    assert "no readable manifest" in cache.problem("tokenizer")
    assert ModelCache(empty_model.gguf, folder).problem("config") is not None


def test_the_tokenizer_equals_transformers_own_gguf_tokenizer(embedded_model):
    from transformers import AutoTokenizer

    gguf = embedded_model.gguf
    ours = build_tokenizer(gguf)
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)


def test_the_transformers_path_builds_transformers_own_config_and_dequantizes_in_memory(embedded_model, tmp_path,
                                                                                       reference_model):
    from transformers import AutoConfig

    own = locate_model(None, tmp_path)
    plain = ModelShard(own, 0, 30, ShardSettings(dtype="float32", compute="transformers"))
    assert plain.compute_path.startswith("transformers (weights dequantized in memory")
    saved = AutoConfig.from_pretrained(str(own.folder)).to_dict()
    expected = reference_model.config.to_dict()
    assert {key for key in expected.keys() | saved.keys() if expected.get(key) != saved.get(key)} <= {
        "architectures", "dtype", "_name_or_path", "transformers_version", "quantization_config"}
    assert not list(own.folder.rglob("*.safetensors"))
    ours = dict(plain.model.named_parameters())
    theirs = dict(reference_model.named_parameters())
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), "the same float32 weights"


def test_copies_an_earlier_meshws_converted_are_found_and_named(tmp_path, caplog):
    old = tmp_path / "SmolLM2-135M-Instruct-0123456789ab" / "float32"
    old.mkdir(parents=True)
    (old / "model.layers.0.safetensors").write_bytes(b"x")
    (tmp_path / "other" / "bfloat16").mkdir(parents=True)  # empty: not a copy
    assert stale_copies(tmp_path) == [old]
    with caplog.at_level(logging.WARNING, logger="meshws.model"):
        resolve_model(str(embedded_gguf_path()), tmp_path)  # a node says so as it starts
    assert f"free them with: rm -r {old}" in caplog.text
    shutil.rmtree(old)
    assert stale_copies(tmp_path) == []
