"""Nodes on one host share its cores instead of fighting over them.

Each node started without `--threads` registers in a directory private to the user
(`$TMPDIR/meshws-nodes-UID/<pid>`) and runs `cores // live nodes` compute threads. Its
compute thread looks again every few seconds (`retune`, between steps), so a head
started alone uses every core and drops to half when a tail starts beside it. Without
this, two nodes each spin every core's OpenMP threads: on a 2-core machine, 16
concurrent fp32 sessions fell to 0.6x one session's throughput (6.8x with one thread
per node). A registration whose process is gone, or is no longer a meshws node (a
reused PID), is removed by whoever sees it.

The share is what torch and OpenBLAS get, and it changes only every few seconds. meshws's
own kernels (whose idle threads yield and then sleep: `native`) are lent more, step by
step: each registration file holds one byte, 1 while that node computes, and a node about
to compute gives its kernels `cores // (1 + other nodes computing now)`. So a head and a
tail that compute in turn (one session, or a head's whole wave: `mesh.waves`) each use
every core for their step, and when both compute, each uses its half.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable

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
        self._check_directory()
        self._lock = threading.Lock()  # the compute thread counts and marks; shutdown closes
        self._mine = self.directory / str(self.pid)
        self._byte = os.open(self._mine, os.O_RDWR | os.O_CREAT, 0o600)  # this node's byte: 1 while it computes
        os.pwrite(self._byte, b"\0", 0)
        self._others: dict[int, int | None] = {}  # the other nodes' bytes, open for reading (None: cannot be)
        self.threads = self.nodes = 0  # and `_checked`: all set by `count`
        self._checked = 0.0
        self.count()

    def _check_directory(self) -> None:
        owner = self.directory.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o022:  # planted by someone else: do not trust it
            raise PermissionError(f"{self.directory} is not this user's own private directory")

    def count(self) -> int:
        """Live meshws nodes registered on this host (this one included); sets `threads` to its share."""
        with self._lock:
            return self._count()

    def _count(self) -> int:
        self._check_directory()  # (gone and made again by someone else: not read)
        live, others = 0, {}
        try:
            for entry in self.directory.iterdir():
                if not entry.name.isdigit():
                    continue
                pid = int(entry.name)
                if pid == self.pid or _is_meshws(pid):
                    live += 1
                    if pid != self.pid:
                        known = self._others.pop(pid, None)
                        others[pid] = known if known is not None else _watch(entry)
                else:
                    entry.unlink(missing_ok=True)
        except OSError:
            others.update(self._others)  # nothing opened is lost: kept for the next count
            self._others = others
            raise
        _close(self._others.values())
        self._others = others
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

    def apply(self, lend: bool = True) -> None:
        """Give the share to whichever library multiplies (torch, or numpy's OpenBLAS: `model.blas`); mark this
        node computing, and (`lend`) lend its kernels the cores no other node of this host computes on now.

        Lending pays when nodes compute in turn: one session, or a head's whole wave (`mesh.waves`). When the
        other node starts computing meanwhile, the borrowed core is shared, and since the kernels' threads take
        a product's units as they come free (`native`), a step then slows by the units its helper holds, not
        to its slowest thread's pace (a static split had a head step take 18 ms instead of 9)."""
        from .model.kernels import blas, native

        blas.set_threads(self.threads)
        with self._lock:
            self._mark(b"\1")
            busy = sum(1 for other in self._others.values() if not _idle(other)) if lend else 0
        native.lend_threads(max(self.threads, self.cores // (1 + busy)) if lend else self.threads)

    def rest(self) -> None:
        """(On the compute thread, once a job no longer computes: before its first result goes out.) This node no
        longer computes."""
        with self._lock:
            self._mark(b"\0")

    def _mark(self, value: bytes) -> None:
        if self._byte >= 0:  # (closed: the number may be another file's by now)
            try:
                os.pwrite(self._byte, value, 0)
            except OSError:
                pass  # a hint to the other nodes, never a reason to fail a step

    def describe(self) -> dict[str, object]:
        return {"threads": self.threads,
                "threads_reason": f"{self.nodes} meshws node(s) on this host share its {self.cores} cores; meshws's "
                                  "kernels borrow the cores of those not computing at the moment"}

    def close(self) -> None:
        from .model.kernels import native

        with self._lock:
            mine, others, self._byte, self._others = self._byte, self._others, -1, {}
        self._mine.unlink(missing_ok=True)
        _close([mine, *others.values()])
        native.lend_threads(None)


def _watch(path: Path) -> int | None:
    """Another node's byte, open for reading: a regular file of ours (no link, no FIFO to block on), read
    with pread (a file cut short reads empty, never faults). None: not readable, counted as computing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    facts = os.fstat(fd)
    if not stat.S_ISREG(facts.st_mode) or facts.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def _idle(fd: int | None) -> bool:
    try:
        return fd is not None and os.pread(fd, 1, 0) == b"\0"
    except OSError:
        return False


def _close(fds: Iterable[int | None]) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            os.close(fd)
