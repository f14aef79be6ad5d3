"""Building meshws's kernels (`kernels.c`, which includes `quants.c`) with this machine's C compiler, once.

The library is compiled once per source, compiler and CPU (`-O3 -march=native`) into the cache
folder (`$MESHWS_CACHE_DIR/native`, else `~/.cache/meshws/models/native`); the compile takes a few
seconds, so a node starts it first thing (`start`), in the background, while Python imports torch:
`library` then waits for it. A library found there that is not ours alone (another owner, or
writable by others) is never loaded. No torch here: this runs before it is imported.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ..gguf.model_files import default_cache_dir

log = logging.getLogger("meshws.shard")

SOURCE = Path(__file__).with_name("kernels.c")
INCLUDED = ("quants.c", "blocks32.c", "kquants_avx2.c", "blocks32_avx2.c")  # by kernels.c, one way or another
SOURCES = (SOURCE, *(SOURCE.with_name(name) for name in INCLUDED))
FLAGS = ["-O3", "-march=native", "-std=c11", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]  # fmaf by hand

_started: threading.Thread | None = None
_lock = threading.Lock()


def compiler() -> list[str]:
    """The C compiler to build with ($CC, else cc or gcc); empty where there is none."""
    configured = shlex.split(os.environ.get("CC", ""))
    found = shutil.which("cc") or shutil.which("gcc")
    return configured or ([found] if found else [])


def start() -> None:
    """Build the library in the background if it is not built yet (a node's first start on a machine)."""
    global _started
    if os.environ.get("MESHWS_NATIVE", "1") == "0" or _started is not None:
        return

    def build_quietly() -> None:
        try:
            library()
        except (OSError, subprocess.SubprocessError):
            pass  # `library` says why when the node asks for it

    _started = threading.Thread(target=build_quietly, name="meshws-kernels", daemon=True)
    _started.start()


def library(rebuild: bool = False) -> Path | None:
    """The built library's path (built now if need be, or waited for if `start` is building it); None without a C
    compiler. OSError or SubprocessError if it cannot be built or is not ours alone."""
    if _started is not None and _started is not threading.current_thread():
        _started.join()
    tools = compiler()
    if not tools:
        return None
    with _lock:
        target = default_cache_dir() / "native" / f"kernels-{_key(tools)}.so"
        if any(path.exists() and not _ours(path) for path in (target.parent, target)):
            raise OSError(f"{target} or its folder is not ours alone (owner, or writable by others): not loaded")
        if rebuild or not target.is_file():
            started = time.monotonic()
            _build(target, tools)
            log.info("built the native kernels in %.1f s: %s", time.monotonic() - started, target)
        return target


def _build(target: Path, tools: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)  # two nodes may build at once
    os.close(handle)
    try:
        subprocess.run([*tools, *FLAGS, "-o", partial, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


def _ours(path: Path) -> bool:
    """Is `path` (a library about to be loaded, or its folder) ours alone: owned by us, writable by no one else?"""
    facts = path.stat()
    return facts.st_uid == os.getuid() and not facts.st_mode & 0o022


def _key(tools: list[str]) -> str:
    """The library's name: its sources, the compiler, and what `-march=native` means on this CPU."""
    version = subprocess.run([*tools, "--version"], capture_output=True, text=True, timeout=30).stdout
    native = subprocess.run([*tools, "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True,
                            timeout=30).stdout  # the macros the CPU turns on: another CPU, another library
    return hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES) + version.encode()
                          + " ".join(FLAGS).encode() + native.encode()).hexdigest()[:16]


if __name__ == "__main__":  # `python -m meshws.model.kernels.kernel_build`: build now (./dev setup does, once)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(library() or "no C compiler: meshws runs without its kernels")
