"""`--out` of the benchmarks: a file, or a folder that gets the report's own name; unwritable places fail first."""

import argparse

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
