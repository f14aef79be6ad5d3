"""The benchmark runs in its short mode and its JSON carries every promised field."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT
from meshws.model.kernels.native import kernels

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


def test_short_benchmark_writes_every_field(tmp_path, embedded_model):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshws.bench", "--short", "--runs", "2", "--dtype", "float32",
                             "--sessions", "1", "4", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    gguf = report["gguf"]  # the GGUF section, beside llama.cpp where llama-cpp-python is installed
    assert gguf["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf["threads"] >= 1
    full, mesh = gguf["full"], gguf["mesh"]
    assert full["decode_tok_s"] > 0 and full["prompt_s"] > 0 and full["start_s"] > 0
    assert 0 < full["written_bytes"] < 0.05 * gguf["size_bytes"]  # the tokenizer's files only
    assert full["peak_bytes"] > full["weights"]["mapped_bytes"] > 0 and "GGUF blocks" in full["path"]
    assert mesh["decode_tok_s"] > 0 and len(mesh["peak_bytes"]) == 2
    assert set(gguf["targets"]) == {"full_decode_ge_1x_llama_cpp", "full_prompt_ge_0_7x_llama_cpp",
                                    "full_peak_le_1_15x_llama_cpp", "full_start_le_llama_cpp_load_plus_3s",
                                    "full_written_le_2_percent", "mesh_decode_ge_0_9x_llama_cpp",
                                    "mesh_each_peak_le_0_65x_llama_cpp"}
    llama_gguf = gguf["llama_cpp"]  # an optional extra
    assert llama_gguf is None or (llama_gguf["decode_tok_s"] > 0 and llama_gguf["load_s"] > 0
                                  and gguf["targets"]["full_decode_ge_1x_llama_cpp"]["value"] > 0)
    assert set(report["results"]) == {"float32"}  # each dtype runs the same code; one keeps the test short
    for dtype, entry in report["results"].items():
        assert entry["generate"]["decode_tok_s"] > 0 and entry["generate"]["ttft_s"] > 0
        assert "full_node_int8" not in entry  # (int8 is for a folder's float weights)
        assert entry["full_node"]["per_session_tok_s"] > 0 and "ratio_to_generate" in entry["full_node"]
        steps = entry["decode_step"]
        # the lean step fused where meshws's kernels run, and the same weights op by op
        names = ["transformers", "lean", "lean_ops"]
        fused = ", decode fused (meshws kernel)" if kernels() else ""
        assert set(steps) == set(names)
        assert steps["transformers"]["path"].startswith("transformers (weights dequantized in memory")
        assert steps["lean"]["path"] == "lean llama, GGUF blocks (Q4_1 x 105), widened exactly to float32" + fused
        assert steps["lean_ops"]["path"] == steps["lean"]["path"]
        for step in steps.values():
            assert step["step_ms"] > 0 and step["floor_ms"] > 0 and step["over_floor"] > 0
        # lean paths also time a 16-session step (`run_rows`, a wave's path); transformers has none
        assert "batch_ms" not in steps["transformers"]
        for name in names[1:]:
            assert steps[name]["batch_ms"] > 0
            assert steps[name]["batch_over_one"] == pytest.approx(steps[name]["batch_ms"] / steps[name]["step_ms"],
                                                                  rel=0.02)
        # the lean shard maps its 15 layers' blocks (0.75 bytes a weight); transformers holds them as float32
        assert steps["lean"]["weight_mib"] < 0.25 * steps["transformers"]["weight_mib"]
        llama = entry["llama_cpp"]  # an optional extra: measured only where llama-cpp-python is installed
        assert llama is None or (llama["decode_tok_s"] > 0 and "ratio_to_llama_cpp" in entry["full_node"])
        sequences = entry["llama_cpp_sessions"]  # llama.cpp's batched decoding of as many sequences, beside the mesh
        assert (sequences is None) == (llama is None)
        if sequences is not None:
            assert set(sequences) == {"1", "4"} and all(seq["aggregate_tok_s"] > 0 for seq in sequences.values())
            assert entry["mesh"]["4"]["aggregate_ratio_to_llama_cpp_sequences"] == pytest.approx(
                entry["mesh"]["4"]["aggregate_tok_s"] / sequences["4"]["aggregate_tok_s"], rel=0.01)
        assert "mesh_int8" not in entry
        assert set(entry["mesh"]) == set(entry["full_node_sessions"]) == set(entry["generate_sessions"]) == {"1", "4"}
        for sessions in entry["mesh"].values():
            for field in ("per_session_tok_s", "aggregate_tok_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s",
                          "itl_p95_s"):
                assert sessions[field] > 0, (dtype, field)
            assert sessions["itl_p95_s"] >= sessions["itl_p50_s"]
            assert set(sessions["busy_fraction"]) == {"head", "tail"}
            runs = sessions["runs_aggregate_tok_s"]  # each figure the median of two runs: between them
            assert len(runs) == 2 and min(runs) <= sessions["aggregate_tok_s"] <= max(runs)
            assert all(0 < fraction <= 1.05 for fraction in sessions["busy_fraction"].values()), sessions
            for field in ("per_session_ratio_to_generate", "aggregate_ratio_to_generate", "aggregate_over_one_session"):
                assert isinstance(sessions[field], float) and sessions[field] >= 0, (dtype, field)  # a busy machine
                # can make a rate tiny next to the baseline; the ratio is there, rounded
        for series in ("full_node_sessions", "generate_sessions"):
            for sessions in entry[series].values():
                assert sessions["aggregate_tok_s"] > 0 and sessions["itl_p95_s"] > 0
        assert entry["joining"]["busy_sessions"] == 3 and entry["joining"]["ttft_s"] > 0
        assert len(entry["joining"]["runs_ttft_s"]) == 2
        width = 4 if dtype == "float32" else 2  # `--wire-dtype auto`: the hidden state as the nodes compute it
        assert 576 * width < entry["wire"]["decode_frame_bytes"] <= 576 * width + 250
        assert entry["wire"]["prefill_frame_bytes"] > entry["wire"]["decode_frame_bytes"]
        assert set(entry["stateless"]) == {"64", "256", "1024"}
        for context in entry["stateless"].values():
            assert context["stateless_step_s"] > context["cached_step_s"] > 0
        assert set(entry["targets"]) == {"mesh_one_session_ge_1x_generate", "mesh_16_sessions_ge_6x_one",
                                         "decode_frame_le_1400_bytes", "cached_ge_15x_stateless_at_1024",
                                         "full_node_ge_2x_generate", "full_node_int8_ge_3x_generate",
                                         "mesh_one_session_ge_1_5x_generate", "full_node_ge_0_5x_llama_cpp",
                                         "mesh_16_p95_itl_le_3x_one", "joining_ttft_le_2x_idle",
                                         "mesh_16_ge_1_5x_generate_16", "mesh_16_ge_1x_llama_cpp_16",
                                         "conversation_ws_chat_ttft_le_0_3x_fresh",
                                         "conversation_openai_api_ttft_le_0_3x_fresh",
                                         "drafts_delayed_repeat_ge_2_tokens_per_lap",
                                         "drafts_delayed_repeat_time_le_0_55x_none",
                                         "drafts_delayed_ordinary_time_le_1_05x_none",
                                         "drafts_loopback_ordinary_time_le_1x_none"}
        spec = entry["speculation"]  # 16 tokens, the delayed link only in --short: the repeated text already
        # takes fewer laps with drafts
        assert "loopback_repeat_ngram" not in spec and entry["targets"]["drafts_loopback_ordinary_time_le_1x_none"] \
            == {"value": None, "met": None}
        for link in ("delayed",):
            for prompt in ("repeat", "ordinary"):
                assert 0.9 < spec[f"{link}_{prompt}_none"]["tokens_per_lap"] <= 1.0  # (an answer's end lap: no token)
                assert spec[f"{link}_{prompt}_ngram"]["token_s"] > 0 and spec[f"{link}_{prompt}_time_ratio"] > 0
        assert spec["delayed_repeat_ngram"]["laps"] < spec["delayed_repeat_none"]["laps"]
        for name in ("ws_chat", "openai_api"):  # two turns in --short: the second reuses the session
            turns = entry["conversation"][name]
            assert len(turns["ttft_reuse_s"]) == len(turns["ttft_fresh_s"]) == 2
            assert turns["cached_tokens"][0] == 0 and all(count > 400 for count in turns["cached_tokens"][1:]), turns
            assert turns["later_turns_ttft_ratio"] > 0
    assert report["plot"] == str(out.with_suffix(".png")) and out.with_suffix(".png").stat().st_size > 10_000
    assert report["bandwidth_gb_s"] > 0
    assert "target" in result.stdout and "x generate" in result.stdout


@pytest.mark.slow
def test_the_scale_suite_places_machines_and_writes_the_issues_ratios(tmp_path, embedded_model):
    """`--suite scale`: one machine, two placed by the head (and one host's split), each figure and ratio there."""
    out = tmp_path / "scale.json"
    result = subprocess.run([sys.executable, "-m", "meshws.bench", "--suite", "scale", "--sessions", "1", "2",
                             "--tokens", "6", "--runs", "1", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    scale = json.loads(out.read_text())["scale"]
    machines = scale["machines"]
    assert set(machines) >= {"1", "2"} and machines["1"]["spans"] == [["full", "0-29"]]
    placed = machines["2"]["spans"]  # the head's plan: a head and a tail, every layer once
    assert [span[0] for span in placed][0] == "head" and placed[0][1][0] == 0 and placed[-1][1][1] == 30
    assert placed[0][1][1] == placed[1][1][0]
    for case in (machines["1"], machines["2"], *scale["one_host"].values()):
        for count in ("1", "2"):
            entry = case["sessions"][count]
            assert entry["aggregate_tok_s"] > 0 and len(entry["busy_share"]) == len(case["cores"])
            assert all(0 < share <= 1 for share in entry["busy_share"])
    ratios = scale["ratios"]
    assert ratios["two_over_one_2_sessions"]["target"] == 1.85 and ratios["two_over_one_2_sessions"]["value"] > 0
    assert ratios["one_host_split_over_full_1_session"]["value"] > 0
