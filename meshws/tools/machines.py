"""Machines simulated on one host, for the placement tests and bench (`../shared/NOTES.md` has the recipe).

A `Machine` is a node process pinned to a core (`taskset`), with a `TMPDIR` of its own (so meshws's core sharing,
which registers nodes under `$TMPDIR`, believes the core is its own, as on a separate host) and its own cgroup v1
CPU quota (`/sys/fs/cgroup/cpu/<name>`, a 10 ms period): `share` 0.15 is a core at 15%, an old or busy machine.
`set_share` changes it while the node runs: a laptop that throttles, a build that starts beside it. Everything
made is removed by `stop`. Needs root and cgroup v1's CPU controller (`available` says).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .launch import NodeProcess

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # a short period keeps the throttling smooth


def available() -> bool:
    """Whether CPU quotas can be set here (cgroup v1's CPU controller, writable)."""
    return (CGROUP_CPU / "cpu.cfs_quota_us").exists() and os.access(CGROUP_CPU, os.W_OK)


class CpuQuota:
    """A cgroup with a CPU quota; processes put in it (and their threads) share at most `share` of one core."""

    def __init__(self, name: str, share: float = 1.0) -> None:
        self.path = CGROUP_CPU / f"meshws-{name}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set_share(share)

    def set_share(self, share: float) -> None:
        """At most `share` of a core from now on (1 or more: no limit)."""
        quota = -1 if share >= 1 else max(1000, int(PERIOD_US * share))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Move what is left back to the root group and remove the group."""
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (CGROUP_CPU / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # (gone meanwhile)
            self.path.rmdir()
        except OSError:
            pass


def wait_for_plan(head: NodeProcess, check: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
    """The head's plan once it is in force, the head ready and `check(plan)` true; RuntimeError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        health = head.health()
        if health["ready"] and health["plan"]["state"] == "live" and check(health["plan"]):
            return health["plan"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no such plan within {timeout:g} s: {health['plan']} {health['problems']}")
        time.sleep(0.3)


class Machine:
    """A node process as a machine of its own: one core, a private TMPDIR, a CPU quota."""

    def __init__(self, *args: str, name: str, core: int, share: float = 1.0, port: int = 0, echo: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix=f"meshws-{name}-")
        self.quota = CpuQuota(name, share)
        try:
            self.node = NodeProcess(*args, name=name, port=port, echo=echo, cpus=str(core),
                                    env={"TMPDIR": self.tmp.name, **(env or {})})
            self.quota.add(self.node.proc.pid)
        except BaseException:
            self.quota.remove()
            self.tmp.cleanup()
            raise

    def set_share(self, share: float) -> None:
        self.quota.set_share(share)

    def stop(self, timeout: float = 15.0) -> int | None:
        try:
            return self.node.stop(timeout)
        finally:
            self.quota.remove()
            self.tmp.cleanup()
