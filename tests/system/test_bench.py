"""The benchmark runs in its short mode and its JSON carries every promised field."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT
from meshws.model.blas import choose_matmul
from meshws.model.native import kernels

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


def test_short_benchmark_writes_every_field(tmp_path, embedded_model):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshws.bench", "--short", "--runs", "2", "--dtype", "float32",
                             "--sessions", "1", "4", "--mesh-quant", "none", "int8", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"float32"}  # each dtype runs the same code; one keeps the test short
    for dtype, entry in report["results"].items():
        assert entry["generate"]["decode_tok_s"] > 0 and entry["generate"]["ttft_s"] > 0
        for name in ("full_node", "full_node_int8"):
            assert entry[name]["per_session_tok_s"] > 0 and "ratio_to_generate" in entry[name]
        steps = entry["decode_step"]
        # the lean step fused where meshws's kernels run, the same weights op by op, and op by op on OpenBLAS
        openblas = ["lean_openblas"] * (choose_matmul("openblas", dtype, False)[0] == "openblas")
        names = ["transformers", "lean", "lean_ops", *openblas, "lean_int8"]
        fused = ", decode fused (meshws kernel)" if kernels() else ""
        codes = ", float32 weights as GGUF codes" * bool(fused and dtype == "float32")  # (a Q4_1 GGUF's layers)
        auto = "lean llama" + ", OpenBLAS products" * (not fused and choose_matmul("auto", dtype, False)[0] == "openblas")
        assert set(steps) == set(names)
        assert [steps[name]["path"] for name in names] == [
            "transformers", auto + fused + codes, auto, *["lean llama, OpenBLAS products"] * len(openblas),
            "lean llama, int8 weights " + ("(meshws kernel)" if kernels() else "(FBGEMM)") + fused]
        for step in steps.values():
            assert step["step_ms"] > 0 and step["floor_ms"] > 0 and step["over_floor"] > 0
        # lean paths also time a 16-session step (`run_rows`, a wave's path); transformers has none
        assert "batch_ms" not in steps["transformers"]
        for name in names[1:]:
            assert steps[name]["batch_ms"] > 0
            assert steps[name]["batch_over_one"] == pytest.approx(steps[name]["batch_ms"] / steps[name]["step_ms"],
                                                                  rel=0.02)
        # a byte per weight (0.25x of fp32's 15 layers), padded by FBGEMM (576 inputs take 1024): 0.40x
        assert steps["lean_int8"]["weight_mib"] < 0.45 * steps["lean"]["weight_mib"] * (2 if dtype == "bfloat16" else 1)
        llama = entry["llama_cpp"]  # an optional extra: measured only where llama-cpp-python is installed
        assert llama is None or (llama["decode_tok_s"] > 0 and "ratio_to_llama_cpp" in entry["full_node"])
        assert set(entry["mesh"]) == set(entry["mesh_int8"]) == set(entry["full_node_sessions"]) \
            == set(entry["generate_sessions"]) == {"1", "4"}
        for sessions in [*entry["mesh"].values(), *entry["mesh_int8"].values()]:
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
        assert 1152 < entry["wire"]["decode_frame_bytes"] <= 1400
        assert entry["wire"]["prefill_frame_bytes"] > entry["wire"]["decode_frame_bytes"]
        assert set(entry["stateless"]) == {"64", "256", "1024"}
        for context in entry["stateless"].values():
            assert context["stateless_step_s"] > context["cached_step_s"] > 0
        assert set(entry["targets"]) == {"mesh_one_session_ge_1x_generate", "mesh_16_sessions_ge_6x_one",
                                         "decode_frame_le_1400_bytes", "cached_ge_15x_stateless_at_1024",
                                         "full_node_ge_2x_generate", "full_node_int8_ge_3x_generate",
                                         "mesh_one_session_ge_1_5x_generate", "full_node_ge_0_5x_llama_cpp",
                                         "mesh_16_p95_itl_le_3x_one", "joining_ttft_le_2x_idle",
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
                assert 0.9 < spec[f"{link}_{prompt}_none"]["tokens_per_lap"] <= 1.0  # (an end-of-answer lap is no token)
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
