"""`--out` of the benchmarks: a file, or a folder that gets the report's own name; unwritable places fail first."""

import argparse
import os

import pytest

from meshws.tools.memory_bench import report_path


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="bench")


def test_a_file_is_written_where_it_is_named_and_its_folder_is_made(tmp_path):
    path = report_path(_parser(), str(tmp_path / "new" / "run.json"), "bench.json")
    assert path == tmp_path / "new" / "run.json" and path.parent.is_dir()


@pytest.mark.parametrize("slash", ["", "/"])
def test_a_folder_gets_the_reports_own_name(tmp_path, slash):
    assert report_path(_parser(), str(tmp_path) + slash, "bench.json") == tmp_path / "bench.json"
    assert report_path(_parser(), str(tmp_path / "later") + "/", "memory.json") == tmp_path / "later" / "memory.json"


def test_a_place_that_cannot_hold_the_report_fails_before_anything_is_measured(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        report_path(_parser(), str(tmp_path / "file" / "bench.json"), "bench.json")
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_a_folder_that_takes_no_files_fails_before_anything_is_measured(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        with pytest.raises(SystemExit):
            report_path(_parser(), str(locked), "bench.json")
        assert "cannot write there" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_a_folder_that_exists_but_holds_no_files_fails_even_for_root(capsys):
    with pytest.raises(SystemExit):
        report_path(_parser(), "/proc/", "bench.json")
    assert "cannot write there" in capsys.readouterr().err


def test_dot_names_the_folder_itself(tmp_path):
    assert report_path(_parser(), str(tmp_path / "new") + "/.", "bench.json") == tmp_path / "new" / "bench.json"
