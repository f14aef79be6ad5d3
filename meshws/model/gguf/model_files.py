"""The small files a GGUF model needs besides its tensors, kept in a cache folder: its tokenizer, and a config.

A node computes on the GGUF's own blocks (`gguf_model`): nothing of its weights is converted or
written. What is written is small, in `<cache>/<name>-<key>/` (the key covers the GGUF's path, size
and mtime):

  tokenizer.json, tokenizer_config.json, chat_template.jinja  part "tokenizer": heads, and tails with grammars
  config.json, generation_config.json, meshws-tensors.json    part "config": the transformers path only
  meshws-manifest.json                                        each part's files, sizes, mtimes
  .locks/                                                     one lock file per part

The tokenizer is built from the GGUF's vocabulary (`tokenizer_files`: a second, against the several
transformers' own GGUF reader takes), in the node's own process, or in a child a head starts before
it imports torch (`build_early`: transformers' import and the build then take another core, and the
node reads the files without transformers, `plain_tokenizer`); the config, which only the
transformers path needs (an architecture the lean path does not run), in a short-lived child
(`conversion`), as transformers' GGUF reader parses the whole vocabulary and leaves its heap behind.
A part is written into a staging folder, renamed into place, then recorded in the manifest (replaced
atomically); a part whose files are missing or disagree with the manifest is rebuilt, never used. A
part's lock keeps nodes started together from building it twice.

Caches of meshws before 0.2 held float copies of the weights (`float32/`, `bfloat16/` folders of
safetensors, gigabytes at 1B and more): nothing reads them now. `stale_copies` finds them, the node
says so once, and `rm -r` of those folders frees the space.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


log = logging.getLogger("meshws.model")

MANIFEST = "meshws-manifest.json"
LAYOUT_VERSION = 3  # 2 and before: float copies of the weights as well (`stale_copies`)
BUILT = "meshws-built: "  # the line a conversion child ends with: the parts it converted, as JSON
IN_PROCESS = ("tokenizer",)  # parts built here (or early, `build_early`); the others in a child (`conversion`)
EARLY_WAIT = 120.0  # seconds `prepare` waits for a child `build_early` started, before building the part itself
_EARLY: dict[tuple[Path, str], tuple[subprocess.Popen, Any]] = {}  # children `build_early` started, not waited for
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the meshws package


def default_cache_dir() -> Path:
    """Where models' files (and the built kernels, compiled graphs, a node's key) are kept: MESHWS_CACHE_DIR, or
    meshws/models under the user's cache folder."""
    configured = os.environ.get("MESHWS_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshws" / "models"


class ModelCache:
    """One GGUF's cache folder: which parts it holds, and getting the missing ones built."""

    def __init__(self, gguf: Path, folder: Path) -> None:
        self.gguf = gguf
        self.folder = folder
        self.converted: list[str] = []  # the parts this object had converted, in order

    def prepare(self, keys: list[str]) -> None:
        """Make the parts `keys` sound: the tokenizer built here (or by the child `build_early` started), the config
        in a child process."""
        early = [key for key in keys if self._wait_early(key)]
        problems = {key: self.problem(key) for key in keys}
        for key, problem in problems.items():
            if problem not in (None, "missing"):
                log.warning("model cache %s: part %s is unusable (%s); rebuilding it", self.folder, key, problem)
        missing = [key for key in keys if problems[key] is not None]
        if early and not set(early) & set(missing):
            log.info("built %s of %s in a child while this node started", ", ".join(early), self.gguf.name)
        if not missing:
            return
        started = time.monotonic()
        built = [key for key in missing if key in IN_PROCESS and self.build_here(key, self._builder(key))]
        elsewhere = [key for key in missing if key not in IN_PROCESS]
        if elsewhere:
            built += run_conversion(self.gguf, self.folder, elsewhere)
        for key in missing:
            if (problem := self.problem(key)) is not None:
                raise RuntimeError(f"model cache {self.folder}: part {key} is unusable after building it: {problem}")
        self.converted += built
        log.info("built %s of %s in %.1f s", ", ".join(built) or "nothing (another node did)", self.gguf.name,
                 time.monotonic() - started)

    def _builder(self, key: str) -> Callable[[Path], None]:
        from .tokenizer_files import write_tokenizer

        return lambda staging: write_tokenizer(self.gguf, staging)

    def build_early(self, key: str) -> None:
        """Start building part `key` (built in process otherwise) in a child now; `prepare` waits for it. The child
        takes the part's lock as any builder does; if it fails, `prepare` builds the part itself."""
        if key not in IN_PROCESS or (self.folder, key) in _EARLY or self.problem(key) is None:
            return
        errors = tempfile.TemporaryFile()  # (what the child says, for a failure's warning: a file never blocks it)
        _EARLY[(self.folder, key)] = (subprocess.Popen(
            [sys.executable, "-m", "meshws.model.gguf.model_files", str(self.gguf), str(self.folder), key],
            env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors), errors)

    def _wait_early(self, key: str) -> bool:
        """Wait for the child `build_early` started for part `key`, if any; True if there was one."""
        started = _EARLY.pop((self.folder, key), None)
        if started is None:
            return False
        child, errors = started
        with errors:
            try:
                child.wait(timeout=EARLY_WAIT)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.returncode:
                errors.seek(0)
                said = errors.read()[-2000:].decode(errors="replace").strip()
                log.warning("the child building the %s of %s failed (exit %s); building it here%s", key,
                            self.gguf.name, child.returncode, f": {said}" if said else "")
        return True

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


def stale_copies(cache_dir: Path) -> list[Path]:
    """Folders of float weight copies that caches of earlier meshws versions hold, which nothing reads now."""
    try:
        return sorted(path for path in Path(cache_dir).glob("*/*") if path.is_dir()
                      and path.name in ("float32", "bfloat16", "float16") and any(path.glob("*.safetensors")))
    except OSError:
        return []


def _child_env() -> dict[str, str]:
    """A building child's environment: this meshws importable, and no model hub asked."""
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))


def run_conversion(gguf: Path, folder: Path, keys: list[str]) -> list[str]:
    """Convert parts `keys` of `gguf` into `folder` in a child process (`conversion`); the parts it built."""
    log.info("converting %s of %s into %s (in a child process)", ", ".join(keys), gguf.name, folder)
    result = subprocess.run([sys.executable, "-m", "meshws.model.gguf.conversion", str(gguf), str(folder), *keys],
                            env=_child_env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"converting {', '.join(keys)} of {gguf} failed:\n{result.stderr[-3000:]}")
    reports = [line[len(BUILT):] for line in result.stdout.splitlines() if line.startswith(BUILT)]
    return list(json.loads(reports[-1])) if reports else []


def main(argv: list[str]) -> None:
    """`python -m meshws.model.gguf.model_files GGUF FOLDER tokenizer`: a part built in process otherwise, built in
    a child (`ModelCache.build_early`) under the part's lock, as a node would build it."""
    if len(argv) != 3 or argv[2] not in IN_PROCESS:
        raise SystemExit(f"usage: python -m meshws.model.gguf.model_files GGUF FOLDER {{{','.join(IN_PROCESS)}}}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = ModelCache(Path(argv[0]), Path(argv[1]))
    cache.build_here(argv[2], cache._builder(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
