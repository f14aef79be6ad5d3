"""Nodes on one host share its cores instead of fighting over them.

Each node started without `--threads` registers in a directory private to the user
(`$TMPDIR/meshws-nodes-UID/<pid>`) and runs `cores // live nodes` compute threads. Its
compute thread looks again every few seconds (`retune`, between steps), so a head
started alone uses every core and drops to half when a tail starts beside it. Without
this, two nodes each spin every core's OpenMP threads: on a 2-core machine, 16
concurrent fp32 sessions fell to 0.6x one session's throughput (6.8x with one thread
per node). A registration whose process is gone, or is no longer a meshws node (a
reused PID), is removed by whoever sees it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger("meshws.node")

RETUNE_SECONDS = 3.0


def _is_meshws(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"meshws" in cmdline


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreShare:
    def __init__(self, directory: Path | None = None, cores: int | None = None, pid: int | None = None) -> None:
        self.directory = directory or Path(tempfile.gettempdir()) / f"meshws-nodes-{os.getuid()}"
        self.cores = cores or usable_cores()
        self.pid = pid or os.getpid()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = self.directory.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o022:  # planted by someone else: do not trust it
            raise PermissionError(f"{self.directory} is not this user's own private directory")
        self._mine = self.directory / str(self.pid)
        self._mine.touch()
        self.threads = self.nodes = 0  # and `_checked`: all set by `count`
        self._checked = 0.0
        self.count()

    def count(self) -> int:
        """Live meshws nodes registered on this host (this one included); sets `threads` to its share."""
        live = 0
        for entry in self.directory.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == self.pid or _is_meshws(pid):
                live += 1
            else:
                entry.unlink(missing_ok=True)
        self.nodes = max(1, live)
        self.threads = max(1, self.cores // self.nodes)
        self._checked = time.monotonic()
        return self.nodes

    def retune(self) -> None:
        """(On the compute thread, between steps.) Count again now and then; follow a changed share."""
        if time.monotonic() - self._checked >= RETUNE_SECONDS:
            before = self.threads
            try:
                self.count()
            except OSError as exc:  # the directory went away (a /tmp cleaner): keep the share we have
                self._checked = time.monotonic()
                log.debug("cannot count this host's nodes: %s", exc)
            if self.threads != before:
                log.info("%d meshws nodes on this host share its %d cores: %d compute threads here (was %d)",
                         self.nodes, self.cores, self.threads, before)
        self.apply()  # every time: cheap when nothing changed, and the compute thread's first job needs it

    def apply(self) -> None:
        """Give the share to whichever library multiplies (torch, or numpy's OpenBLAS: `model.blas`)."""
        from .model import blas

        blas.set_threads(self.threads)

    def describe(self) -> dict[str, object]:
        return {"threads": self.threads,
                "threads_reason": f"{self.nodes} meshws node(s) on this host share its {self.cores} cores"}

    def close(self) -> None:
        self._mine.unlink(missing_ok=True)
