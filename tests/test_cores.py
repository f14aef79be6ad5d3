"""Nodes on one host split its cores: registration, counting, stale entries, and the thread setting."""

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fakes import FakeBackend
from meshws.cores import RETUNE_SECONDS, CoreShare
from meshws.mesh.compute import ComputeWorker
from meshws.model.kernels import blas, native


def _lookalike():
    """A process whose command line names meshws, as a node's does: returned once it has exec'd (before,
    /proc shows the parent's command line, and the count would rightly take it for a stranger)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "meshws"])
    deadline = time.monotonic() + 10
    while b"meshws" not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return sleeper


def test_nodes_on_one_host_share_the_cores_and_forget_the_dead(tmp_path):
    share = CoreShare(tmp_path, cores=4)
    assert (share.nodes, share.threads) == (1, 4)
    other = _lookalike()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / str(other.pid)).touch()  # another node registered
        (tmp_path / str(stranger.pid)).touch()  # a reused PID: alive, but no meshws node
        (tmp_path / "notes.txt").touch()  # not a registration at all
        assert share.count() == 2 and share.threads == 2
        assert not (tmp_path / str(stranger.pid)).exists()
        assert (tmp_path / "notes.txt").exists()
    finally:
        other.kill()
        stranger.kill()
        other.wait()
        stranger.wait()
    assert share.count() == 1 and share.threads == 4
    assert not (tmp_path / str(other.pid)).exists()
    share.close()
    assert not (tmp_path / str(os.getpid())).exists()


def test_more_nodes_than_cores_still_get_one_thread_each(tmp_path):
    shares = [CoreShare(tmp_path, cores=2, pid=os.getpid())]
    sleepers = [_lookalike() for _ in range(2)]
    try:
        for sleeper in sleepers:
            (tmp_path / str(sleeper.pid)).touch()
        assert shares[0].count() == 3 and shares[0].threads == 1
        before = blas.threads()
        try:
            shares[0].apply()
            assert blas.threads() == 1
        finally:
            blas.set_threads(before)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_a_directory_someone_else_could_write_is_refused(tmp_path):
    shared = tmp_path / "open"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError):
        CoreShare(shared, cores=2)


def test_a_vanished_directory_keeps_the_share_and_the_worker_alive(tmp_path):
    share = CoreShare(tmp_path / "nodes", cores=2)
    shutil.rmtree(tmp_path / "nodes")  # a /tmp cleaner
    share._checked -= RETUNE_SECONDS  # due for a count
    before = torch.get_num_threads()
    try:
        share.retune()
        assert share.threads == 2
        worker = ComputeWorker(FakeBackend(), retune=lambda: 1 / 0)  # even a retune that raises
        try:
            assert worker._thread.is_alive()
            assert asyncio.run(worker.call(lambda: 42)) == 42
        finally:
            worker.shutdown()
    finally:
        torch.set_num_threads(before)


def test_the_kernels_borrow_the_cores_of_nodes_not_computing_now(tmp_path):
    share = CoreShare(tmp_path, cores=2)
    other = _lookalike()
    before = blas.threads()
    try:
        (tmp_path / str(other.pid)).write_bytes(b"\0")  # another node, idle
        assert share.count() == 2 and share.threads == 1
        share.apply()  # about to compute: the idle node's core is lent to this one's kernels
        assert native.threads() == 2 and (tmp_path / str(os.getpid())).read_bytes() == b"\1"
        (tmp_path / str(other.pid)).write_bytes(b"\1")  # the other node computes too: each keeps its share
        share.apply()
        assert native.threads() == 1 and blas.threads() == 1
        (tmp_path / str(other.pid)).write_bytes(b"\0")  # idle again (between a head's waves: `mesh.waves`)
        share.retune()
        assert native.threads() == 2
        share.rest()
        assert (tmp_path / str(os.getpid())).read_bytes() == b"\0"
        (tmp_path / str(other.pid)).write_bytes(b"")  # a byte not readable (yet): counted as computing
        share._checked -= RETUNE_SECONDS
        share.retune()
        assert native.threads() == 1
        calls = []
        worker = ComputeWorker(FakeBackend(), retune=lambda: calls.append("retune"),
                               rest=lambda: calls.append("rest"))
        try:
            asyncio.run(worker.call(lambda: 42))
        finally:
            worker.shutdown()
        assert calls[-2:] == ["retune", "rest"], "a job is bracketed: marked computing, then resting"
    finally:
        other.kill()
        other.wait()
        share.close()
        native.lend_threads(None)
        blas.set_threads(before)
    assert native.threads() == torch.get_num_threads()


def test_a_registration_that_is_a_fifo_or_a_link_is_never_opened_as_a_byte(tmp_path):
    share = CoreShare(tmp_path, cores=2)
    fifo_node, link_node = _lookalike(), _lookalike()
    try:
        os.mkfifo(tmp_path / str(fifo_node.pid))  # opening it for reading would block the compute thread
        (tmp_path / str(link_node.pid)).symlink_to(tmp_path / str(os.getpid()))
        assert share.count() == 3  # returns: neither was opened to wait on
        assert share._others == {fifo_node.pid: None, link_node.pid: None}
        share.apply()
        assert native.threads() == 1, "a byte that cannot be read counts as a node computing"
    finally:
        for node in (fifo_node, link_node):
            node.kill()
            node.wait()
        share.close()
        native.lend_threads(None)
