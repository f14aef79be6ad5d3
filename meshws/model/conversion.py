"""`python -m meshws.model.conversion GGUF FOLDER PART...`: convert cache parts, in a child process.

A part is "config" (`config.json`, `generation_config.json` and the tensor name map),
"tokenizer" (the tokenizer and chat template) or "<dtype>/<module>" (one decoder layer,
or the embeddings, the final norm, the LM head, in that dtype). All come out as
`from_pretrained(..., gguf_file=...)` makes them: the config and the tokenizer from
transformers' GGUF readers, the tensors through `gguf_convert`.

`span_cache` runs this in a short-lived child process and waits for it. The node's own
memory then holds only what it maps: the config reader parses the whole vocabulary
(~180 MB at its peak for SmolLM2, ~750 MB for Gemma-3), dequantising leaves a
fragmented heap behind, and a process that converted would keep ~60-100 MB more than
one that only loaded. The child takes each part's lock, skips parts another node
finished meanwhile, and records each part in the manifest as soon as it is written.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .gguf_convert import TENSOR_MAP, GgufTensors, tensor_name_map
from .span_cache import BUILT, ModelCache


def write_config(gguf: Path, out: Path) -> None:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with init_empty_weights(include_buffers=False):  # a skeleton on the meta device: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    names = tensor_name_map(gguf, skeleton)
    # As `save_pretrained` on the loaded model writes it: the class, and the dtype of the cache on disk.
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    (out / TENSOR_MAP).write_text(json.dumps(names, indent=1))


def write_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


class PartWriter:
    """Builds one part into a staging folder; opens the GGUF's tensor table once for all tensor parts."""

    def __init__(self, gguf: Path, folder: Path) -> None:
        self.gguf, self.folder = gguf, folder
        self._tensors: GgufTensors | None = None

    def __call__(self, key: str, staging: Path) -> None:
        if key == "config":
            write_config(self.gguf, staging)
        elif key == "tokenizer":
            write_tokenizer(self.gguf, staging)
        else:
            self._write_tensors(key, staging)

    def _write_tensors(self, key: str, staging: Path) -> None:
        from safetensors.torch import save_file

        from .tensors import TORCH_DTYPES

        dtype, part = key.split("/", 1)
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown cache part {key!r}")
        if self._tensors is None:
            self._tensors = GgufTensors(self.gguf, self.folder)
        tensors = self._tensors.convert(part, TORCH_DTYPES[dtype])
        (staging / dtype).mkdir()
        save_file(tensors, str(staging / dtype / f"{part}.safetensors"), metadata={"source": self.gguf.name})


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -m meshws.model.conversion GGUF FOLDER PART...")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf, folder = Path(argv[0]), Path(argv[1])
    cache, writer = ModelCache(gguf, folder), PartWriter(gguf, folder)
    built = []
    for request in argv[2:]:
        for key in cache.expand([request]):  # a span needs the config, which an earlier request wrote
            if cache.build_here(key, lambda staging, key=key: writer(key, staging)):
                built.append(key)
    print(BUILT + json.dumps(built), flush=True)  # what this child converted; others may have done the rest


if __name__ == "__main__":
    main(sys.argv[1:])
