"""Each architecture's GGUF through a real head + tail (node processes over websockets), against transformers.

Tiny synthetic files (`synth_gguf`: Llama, Qwen2, Qwen3, and one with every block type the kernels compute on),
float32 on both nodes and on the wire: greedy tokens equal transformers' `generate()` on the same file, and the
prompt's log-probabilities (echo) agree within 1e-3. The nodes start from an empty model cache and write only
the head's tokenizer.
"""

from pathlib import Path

import pytest
import torch

from helpers import complete_ids
from meshws.tools.launch import Mesh
from meshws.tools.synth_gguf import write

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

EXACT = ("--dtype", "float32", "--wire-dtype", "float32")
PROMPT = "Once upon a time, in a land far away, there lived a"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-mesh")


@pytest.mark.parametrize("arch,quant", [("llama", "q4_k_m"), ("qwen2", "q4_k_m"), ("qwen3", "q4_k_m"),
                                        ("llama", "mixed")])
async def test_a_head_and_tail_give_transformers_tokens_and_logprobs(folder, arch, quant):
    import aiohttp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(write(str(folder / f"{arch}-{quant}.gguf"), "tiny", arch, quant))
    cache = folder / f"cache-{arch}-{quant}"  # the model cache (the built kernels stay where they are)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(PROMPT)["input_ids"]
    with torch.inference_mode():
        golden = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
        logits = reference(torch.tensor([ids])).logits[0].float()
    oracle = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    mesh = Mesh([("head", "0-1"), ("tail", "2-3")], common=("--model", str(path), "--cache-dir", str(cache), *EXACT))
    try:
        health = mesh.tail.health()
        assert health["compute"]["path"].startswith("lean llama, GGUF blocks")
        tokens, _ = await complete_ids(mesh.head.url, ids, 16, model=path.stem, ignore_eos=True)
        assert tokens == golden
        body = {"model": path.stem, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{mesh.head.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
        echoed = answer["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
        assert (torch.tensor(echoed) - oracle).abs().max() < 1e-3
    finally:
        mesh.stop()
    written = [item for item in cache.rglob("*") if item.is_file()]
    assert {item.name for item in written} >= {"tokenizer.json"}
    assert not any(item.suffix == ".safetensors" for item in written)
