"""`python -m meshws.model.gguf.conversion GGUF FOLDER config`: a GGUF's transformers config, built in a child process.

Only the transformers path (an architecture the lean path does not run, or `--compute transformers`)
needs it: `config.json` and `generation_config.json` as `from_pretrained(..., gguf_file=...)` makes
them, and the map from the GGUF's tensor names to the model's (`gguf_convert`). `model_files` runs
this in a short-lived child and waits for it: transformers' config reader parses the whole vocabulary
(~180 MB at its peak for SmolLM2, ~750 MB for Gemma-3), which would stay in the node's heap. The child
takes the part's lock, skips it if another node finished it meanwhile, and records it in the manifest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .gguf_convert import TENSOR_MAP, tensor_name_map
from .model_files import BUILT, ModelCache


def write_config(gguf: Path, out: Path) -> None:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with init_empty_weights(include_buffers=False):  # a skeleton on the meta device: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    names = tensor_name_map(gguf, skeleton)
    # As `save_pretrained` on the loaded model writes it: the class, and the dtype it was loaded in.
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    (out / TENSOR_MAP).write_text(json.dumps(names, indent=1))


def main(argv: list[str]) -> None:
    if len(argv) < 3 or any(part != "config" for part in argv[2:]):
        raise SystemExit("usage: python -m meshws.model.gguf.conversion GGUF FOLDER config")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf, folder = Path(argv[0]), Path(argv[1])
    built = ["config"] if ModelCache(gguf, folder).build_here("config", lambda staging: write_config(gguf, staging)) \
        else []
    print(BUILT + json.dumps(built), flush=True)  # what this child built; another node may have done it


if __name__ == "__main__":
    main(sys.argv[1:])
