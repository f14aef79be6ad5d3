"""The benchmark runs in its short mode and its JSON carries every promised field."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


def test_short_benchmark_writes_every_field(tmp_path, embedded_model):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshws.bench", "--short", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"bfloat16", "float32"}
    for dtype, entry in report["results"].items():
        assert entry["generate"]["decode_tok_s"] > 0 and entry["generate"]["ttft_s"] > 0
        assert entry["full_node"]["per_session_tok_s"] > 0 and "ratio_to_generate" in entry["full_node"]
        assert set(entry["mesh"]) == {"1", "4", "16"}
        for sessions in entry["mesh"].values():
            for field in ("per_session_tok_s", "aggregate_tok_s", "ttft_p50_s", "ttft_p95_s"):
                assert sessions[field] > 0, (dtype, field)
            for field in ("per_session_ratio_to_generate", "aggregate_ratio_to_generate", "aggregate_over_one_session"):
                assert isinstance(sessions[field], float) and sessions[field] >= 0, (dtype, field)  # a busy machine
                # can make a rate tiny next to the baseline; the ratio is there, rounded
        assert 1152 < entry["wire"]["decode_frame_bytes"] <= 1400
        assert entry["wire"]["prefill_frame_bytes"] > entry["wire"]["decode_frame_bytes"]
        assert set(entry["stateless"]) == {"64", "256", "1024"}
        for context in entry["stateless"].values():
            assert context["stateless_step_s"] > context["cached_step_s"] > 0
        assert set(entry["targets"]) == {"mesh_one_session_ge_1x_generate", "mesh_16_sessions_ge_6x_one",
                                         "decode_frame_le_1400_bytes", "cached_ge_15x_stateless_at_1024"}
    assert "target" in result.stdout and "x generate" in result.stdout
