"""`--out` of the benchmarks: a file, or a folder that gets the report's own name; unwritable places fail first. The
GGUF section's split and its picture of several runs; the many-sessions figures set beside llama.cpp's sequences and
generate()'s batch, and `--pin`'s nodes under taskset."""

import argparse
import os
import shutil
import sys

import pytest

from meshws.tools.bench import add_ratios, targets
from meshws.tools.bench_gguf import split_roles
from meshws.tools.bench_llama import measure_llama_cpp_sessions
from meshws.tools.bench_plot import write_gguf_plot
from meshws.tools.launch import NodeProcess
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


@pytest.mark.parametrize("layers, parts, spans", [
    (16, 2, [("head", "0-7"), ("tail", "8-15")]),
    (32, 3, [("head", "0-9"), ("middle", "10-20"), ("tail", "21-31")]),
    (30, 4, [("head", "0-6"), ("middle", "7-14"), ("middle", "15-21"), ("tail", "22-29")]),
])
def test_a_split_shares_every_layer_once_in_order(layers, parts, spans):
    assert split_roles(layers, parts) == spans


def test_several_runs_make_one_picture_and_a_run_without_llama_cpp_none(tmp_path):
    pytest.importorskip("matplotlib")

    def section(name, parts):
        return {"file": name, "threads": 2, "llama_cpp": {"decode_tok_s": 40.0, "prompt_s": 5.0, "peak_bytes": 1000},
                "full": {"decode_tok_s": 38.0, "prompt_s": 6.0, "peak_bytes": 800},
                "mesh": {"decode_tok_s": 33.0, "peak_bytes": [400] * parts}}

    picture = write_gguf_plot([section("1b.gguf", 2), section("8b.gguf", 3)], tmp_path / "gguf.png")
    assert picture is not None and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_gguf_plot([{**section("x.gguf", 2), "llama_cpp": None}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not shutil.which("taskset"), reason="no taskset here")
def test_a_pinned_node_starts_under_taskset_on_its_core():  # (`bench --pin`: the head on one core, the tail on another)
    core = str(sorted(os.sched_getaffinity(0))[0])
    node = NodeProcess("--help", cpus=core)
    assert node.proc.wait(timeout=60) == 0
    assert node.proc.args[:3] == ["taskset", "-c", core] and node.proc.args[4:6] == ["-m", "meshws.node"]


def _sessions_result(llama_cpp: bool) -> dict:
    def mesh(one: float, sixteen: float) -> dict:
        return {"1": {"sessions": 1, "per_session_tok_s": one, "aggregate_tok_s": one},
                "16": {"sessions": 16, "per_session_tok_s": sixteen / 16, "aggregate_tok_s": sixteen}}

    return {"generate": {"decode_tok_s": 50.0}, "generate_sessions": {"16": {"aggregate_tok_s": 150.0}},
            "llama_cpp": {"decode_tok_s": 100.0} if llama_cpp else None,
            "llama_cpp_sessions": {"1": {"aggregate_tok_s": 125.0}, "16": {"aggregate_tok_s": 200.0}} if llama_cpp
            else None,
            "mesh": mesh(100.0, 240.0), "mesh_pinned": mesh(90.0, 300.0), "full_node": {"per_session_tok_s": 80.0},
            "stateless": {}}


def test_each_mesh_series_is_set_beside_llama_cpps_as_many_sequences_and_generates_batch_of_16():
    result = _sessions_result(llama_cpp=True)
    add_ratios(result)
    assert result["mesh"]["1"]["aggregate_ratio_to_llama_cpp_sequences"] == 0.8
    assert result["mesh_pinned"]["16"]["aggregate_ratio_to_llama_cpp_sequences"] == 1.5
    checks = targets(result)  # (the float mesh's figures, not the pinned one's)
    assert checks["mesh_16_ge_1x_llama_cpp_16"] == {"value": 1.2, "met": True}
    assert checks["mesh_16_ge_1_5x_generate_16"] == {"value": 1.6, "met": True}


def test_without_llama_cpp_its_sequences_are_not_measured_and_their_target_says_so(monkeypatch, tmp_path):
    result = _sessions_result(llama_cpp=False)
    add_ratios(result)
    assert "aggregate_ratio_to_llama_cpp_sequences" not in result["mesh"]["16"]
    assert targets(result)["mesh_16_ge_1x_llama_cpp_16"] == {"value": None, "met": None}
    assert measure_llama_cpp_sessions(None, [1, 2, 3], 8, [1, 16]) is None  # no GGUF
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # llama-cpp-python not installed
    assert measure_llama_cpp_sessions(tmp_path / "model.gguf", [1, 2, 3], 8, [1, 16]) is None
