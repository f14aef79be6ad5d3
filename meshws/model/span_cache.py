"""The converted-model cache: a GGUF's tensors as float safetensors, one part at a time, as spans ask.

`<cache>/<name>-<key>/` (the key covers the GGUF's path, size and mtime) holds:

  config.json, generation_config.json, meshws-tensors.json   part "config": every node
  tokenizer.json, tokenizer_config.json, chat_template.jinja part "tokenizer": heads only
  float32/model.layers.7.safetensors                         part "float32/model.layers.7"
  float32/model.embed_tokens.safetensors, .../model.norm...  one file per layer or module,
  bfloat16/...                                               per compute dtype
  meshws-manifest.json                                       each part's files, sizes, mtimes
  .locks/                                                    one lock file per part

A node converts only the parts its span lacks, so nodes on one machine with overlapping
spans share files and a new span converts only the new layers. The conversion runs in a
child process (`conversion`), so the node itself only maps files. A part is written into a
staging folder, renamed into place, then recorded in the manifest (replaced atomically);
a part whose files are missing, disagree with the manifest, or whose safetensors header
does not match the file's size is rebuilt, never used. A part's lock keeps nodes started
together from converting it twice; nodes with disjoint spans convert side by side.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .gguf_convert import LAYER_PART, TENSOR_MAP, part_of

log = logging.getLogger("meshws.model")

MANIFEST = "meshws-manifest.json"
LAYOUT_VERSION = 2
BUILT = "meshws-built: "  # the line a conversion child ends with: the parts it converted, as JSON
SPAN = "span:"  # a conversion request `span:dtype:start:end`, expanded into parts once the config exists
INDEX = "model.safetensors.index.json"  # written only by `ensure_whole`, for transformers' from_pretrained
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the meshws package


class ModelCache:
    """One GGUF's cache folder: which parts it holds, and getting the missing ones converted."""

    def __init__(self, gguf: Path, folder: Path) -> None:
        self.gguf = gguf
        self.folder = folder
        self.converted: list[str] = []  # the parts this object had converted, in order

    def tensor_names(self) -> set[str]:
        """The model tensors the GGUF provides (once the "config" part is converted)."""
        return set(json.loads((self.folder / TENSOR_MAP).read_text())["tensors"].values())

    def prepare_span(self, start: int, end: int | None, dtype: str, tokenizer: bool) -> None:
        """Convert what a shard of layers `[start, end)` lacks (config, tokenizer, tensors) in one child.

        Which tensor parts a shard needs is decided by `weights` from the model's own
        parameter names; this is a forecast that lets one child do all the work on a
        first start. Were it to miss a part, `tensor_files` would convert it later.
        """
        keys = ["config"] + (["tokenizer"] if tokenizer else [])
        if self.problem("config") is None:
            keys += self.span_parts(f"{dtype}:{start}:{'' if end is None else end}")
        else:  # the child expands it once it has written the config
            keys.append(f"{SPAN}{dtype}:{start}:{'' if end is None else end}")
        self.prepare(keys)

    def span_parts(self, span: str) -> list[str]:
        """The tensor parts `dtype:start:end` forecasts: its layers; embeddings, final norm, LM head."""
        dtype, start, end = span.split(":")
        total = json.loads((self.folder / "config.json").read_text())["num_hidden_layers"]
        first, last = int(start), int(end or total)
        if not 0 <= first < last <= total:
            raise ValueError(f"layer range [{first}, {last}) is not within the model's {total} layers")
        names = self.tensor_names()
        modules = {part_of(name) for name in names if not LAYER_PART.match(name)}
        parts = {part_of(name) for name in names if (m := LAYER_PART.match(name))
                 and first <= int(m.group(1).rsplit(".", 1)[1]) < last}
        if first == 0:
            parts |= {part for part in modules if "embed" in part}
        if last == total:
            tied = not any(part.endswith("lm_head") for part in modules)
            parts |= {part for part in modules if "embed" not in part or tied}
        return [f"{dtype}/{part}" for part in sorted(parts)]

    def tensor_files(self, names: Iterable[str], dtype: str) -> dict[str, Path]:
        """The file holding each named tensor in `dtype`, converting the parts the cache lacks."""
        names = sorted(set(names))
        self.prepare(sorted({f"{dtype}/{part_of(name)}" for name in names}))
        return {name: self.folder / dtype / f"{part_of(name)}.safetensors" for name in names}

    def ensure_whole(self) -> Path:
        """Every part in float32, and an index so `from_pretrained(folder)` loads the whole model.

        Nodes never need this; tests and the benchmark use it for their reference model.
        """
        files = self.tensor_files(self.tensor_names(), "float32")

        def write_index(staging: Path) -> None:
            weight_map = {name: path.relative_to(self.folder).as_posix() for name, path in files.items()}
            total = sum(path.stat().st_size for path in set(files.values()))
            (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))

        self.build_here("index", write_index)
        return self.folder

    def prepare(self, keys: list[str]) -> None:
        """Make the parts `keys` sound, converting the missing or damaged ones in one child process."""
        problems = {key: self.problem(key) for key in keys if not key.startswith(SPAN)}
        for key, problem in problems.items():
            if problem not in (None, "missing"):
                log.warning("model cache %s: part %s is unusable (%s); rebuilding it", self.folder, key, problem)
        missing = [key for key in keys if key.startswith(SPAN) or problems[key] is not None]
        if not missing:
            return
        started = time.monotonic()
        built = run_conversion(self.gguf, self.folder, missing)
        wanted = self.expand(missing)
        for key in wanted:
            if (problem := self.problem(key)) is not None:
                raise RuntimeError(f"model cache {self.folder}: part {key} is unusable after conversion: {problem}")
        self.converted += built
        log.info("converted %s of %s in %.1f s; %d more parts were in the cache or converted by another node",
                 _summary(built) or "nothing", self.gguf.name, time.monotonic() - started,
                 len(set(self.expand(keys)) - set(built)))

    def expand(self, keys: list[str]) -> list[str]:
        """The part keys, with each `span:` key replaced by the parts it forecasts."""
        return [part for key in keys for part in (self.span_parts(key[len(SPAN):]) if key.startswith(SPAN) else [key])]

    # -- parts: check, convert, record --------------------------------------------

    def problem(self, key: str) -> str | None:
        """None when part `key` is complete and unchanged since conversion, else what is wrong."""
        try:
            manifest = self._read_manifest()
        except FileNotFoundError:
            return "missing"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"no readable manifest ({type(exc).__name__})"
        files = manifest["parts"].get(key)
        if files is None:
            return "missing"
        for name, recorded in files.items():
            try:
                stat = (self.folder / name).stat()
            except OSError:
                return f"{name} is missing"
            if stat.st_size != recorded["size"] or stat.st_mtime_ns != recorded["mtime_ns"]:
                return f"{name} changed since conversion"
            if name.endswith(".safetensors") and (problem := check_safetensors(self.folder / name)):
                return f"{name}: {problem}"
        return None

    def build_here(self, key: str, build: Callable[[Path], None]) -> bool:
        """Build part `key` in this process with `build(staging)`, unless it is sound; True if built."""
        if self.problem(key) is None:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock(key):
            problem = self.problem(key)
            if problem is None:  # another node converted it while this one waited
                return False
            if problem != "missing":
                log.warning("model cache %s: part %s is unusable (%s); rebuilding it", self.folder, key, problem)
            for stale in self.folder.glob(f".staging-*-{key.replace('/', '_')}"):  # left by a crash; ours now
                shutil.rmtree(stale, ignore_errors=True)
            staging = self.folder / f".staging-{os.getpid()}-{key.replace('/', '_')}"
            staging.mkdir()
            try:
                build(staging)
                files: dict[str, dict[str, int]] = {}
                for path in sorted(path for path in staging.rglob("*") if path.is_file()):
                    relative = path.relative_to(staging).as_posix()
                    (self.folder / relative).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(path, self.folder / relative)
                    stat = (self.folder / relative).stat()
                    files[relative] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
                self._record(key, files)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        problem = self.problem(key)
        if problem is not None:
            raise RuntimeError(f"model cache {self.folder}: part {key} is unusable right after conversion: {problem}")
        return True

    def _read_manifest(self) -> dict[str, Any]:
        manifest = json.loads((self.folder / MANIFEST).read_text())
        if manifest.get("version") != LAYOUT_VERSION or not isinstance(manifest["parts"], dict):
            raise ValueError("another layout version")
        return manifest

    def _record(self, key: str, files: dict[str, dict[str, int]]) -> None:
        with self._lock("manifest"):
            try:
                manifest = self._read_manifest()
            except (OSError, ValueError, KeyError, TypeError):
                manifest = {"version": LAYOUT_VERSION, "source": str(self.gguf), "parts": {}}
            manifest["parts"][key] = files
            partial = self.folder / f"{MANIFEST}.partial-{os.getpid()}"
            partial.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            os.replace(partial, self.folder / MANIFEST)

    @contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        locks = self.folder / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with (locks / f"{key.replace('/', '_')}.lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def check_safetensors(path: Path) -> str | None:
    """None when the header parses and the tensors it lists end exactly at the file's end."""
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


def run_conversion(gguf: Path, folder: Path, keys: list[str]) -> list[str]:
    """Convert parts `keys` of `gguf` into `folder` in a child process (`conversion`); the parts it built."""
    log.info("converting %s of %s into %s (in a child process)", _summary(keys), gguf.name, folder)
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    result = subprocess.run([sys.executable, "-m", "meshws.model.conversion", str(gguf), str(folder), *keys],
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"converting {_summary(keys)} of {gguf} failed:\n{result.stderr[-3000:]}")
    reports = [line[len(BUILT):] for line in result.stdout.splitlines() if line.startswith(BUILT)]
    return list(json.loads(reports[-1])) if reports else []


def _summary(keys: list[str]) -> str:
    """`config, float32 x 11` rather than eleven part names."""
    named = [key for key in keys if "/" not in key]
    counts: dict[str, int] = {}
    for key in keys:
        if "/" in key:
            counts[key.split("/")[0]] = counts.get(key.split("/")[0], 0) + 1
    return ", ".join(named + [f"{count} {dtype} tensor parts" for dtype, count in counts.items()])
