"""A GGUF's tokenizer as transformers builds it, in about a second: its files written into a cache part.

transformers turns a GGUF's vocabulary into a tokenizer (`AutoTokenizer.from_pretrained(folder,
gguf_file=...)`) by reading the metadata with its own reader, a string at a time through numpy (two
seconds for SmolLM2's 49k tokens and merges, before any tokenizer is built). The building itself is
quick, so this reads the arrays with `gguf_file`'s reader (a tenth of a second) and hands them to the
same builder (`convert_gguf_tokenizer`) with the same settings: the same tokenizer, which a test
compares with transformers' own. Where the builder's module is not what this expects (another
transformers), the plain way is taken.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .gguf_file import read_table

log = logging.getLogger("meshws.model")

ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
          "tokenizer.ggml.precompiled_charsmap")


def build_tokenizer(gguf: Path) -> Any:
    """The tokenizer a GGUF describes (a transformers fast tokenizer)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

        renames, special, convert = mapping.GGUF_TOKENIZER_MAPPING, mapping._SPECIAL_TOKENS, \
            mapping.convert_gguf_tokenizer
    except (ImportError, AttributeError):  # another transformers: its own, slower way
        from transformers import AutoTokenizer

        log.info("building the tokenizer of %s the slower way (transformers' GGUF reader)", gguf.name)
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    table = read_table(gguf, ARRAYS)
    metadata = table.metadata
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in keys.items()
                       if f"tokenizer.{key}" in metadata} for group, keys in renames.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # (as `get_gguf_tokenizer` decides these)
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    tokens = tokenizer.get("tokens")
    if not isinstance(tokens, list):
        raise ValueError(f"{gguf.name} holds no vocabulary (tokenizer.ggml.tokens)")
    for name, key in special.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None
    backend, extra = convert(table.architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def write_tokenizer(gguf: Path, folder: Path) -> None:
    """The tokenizer's files (`tokenizer.json`, its config, `chat_template.jinja`), as transformers saves them."""
    build_tokenizer(gguf).save_pretrained(str(folder))

