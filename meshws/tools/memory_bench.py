"""`python -m meshws.tools.memory_bench`: a node's memory against its share of the layers.

Each span is measured in a fresh Python process with a fresh, empty model cache, as a
node's first start on a new machine: the process imports torch and meshws, starts a
shard of those layers (a head builds its tokenizer), then runs one prefill so the
weights it maps are resident. It reports the shard's weight bytes, the seconds to
start, the peak resident memory (VmHWM, the whole life of the process) and the steady
one (VmRSS after the prefill). A process that only imports gives the runtime baseline;
ratios compare each span's memory above that baseline with a `full` node's.

Targets (issue 20): a third of the layers <= 0.6x a full node, a half <= 0.75x, for the
peak and the steady figure alike. `meshws.tools.bench` includes this section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBE_TOKENS = 64
TARGETS = {"third": 0.6, "half": 0.75}  # the share of layers -> the largest ratio to a full node


def spans_for(total: int) -> dict[str, tuple[int, int]]:
    """full, the two halves and the last third of `total` layers, as [start, end)."""
    return {"full": (0, total), "half_head": (0, total // 2), "half_tail": (total // 2, total),
            "third_tail": (total - total // 3, total)}


def probe(model: str, span: tuple[int, int] | None, cache_dir: str, dtype: str) -> dict[str, Any]:
    """In this (fresh) process: the baseline, or start `span` and run one prefill through it."""
    import torch  # noqa: F401 - the runtime every node imports

    from ..model.memory import process_memory
    from ..model.shard import ModelShard, ShardSettings

    baseline = process_memory()
    if span is None:
        return {"peak_bytes": baseline["peak_resident_bytes"], "steady_bytes": baseline["resident_bytes"]}
    started = time.monotonic()
    shard = ModelShard(model, span[0], span[1], ShardSettings(dtype=dtype), cache_dir=cache_dir)
    start_s = time.monotonic() - started
    at_start = shard.memory()
    ids = list(range(1, PROBE_TOKENS + 1))
    if shard.is_head:
        shard.encode_prompt(ids)
    else:
        hidden = torch.randn(1, PROBE_TOKENS, shard.hidden_size, generator=torch.Generator().manual_seed(0))
        shard.forward_bytes(hidden.numpy().tobytes(), list(hidden.shape), dtype="float32")
    after = shard.memory()
    written = sum(path.stat().st_size for path in Path(cache_dir).rglob("*") if path.is_file())
    return {"layers": list(span), "weight_bytes": after["weight_bytes"], "start_s": round(start_s, 2),
            "weights_resident_bytes": after.get("weights_resident_bytes"), "cache_written_bytes": written,
            "resident_at_start_bytes": at_start["resident_bytes"],
            "peak_bytes": after["peak_resident_bytes"], "steady_bytes": after["resident_bytes"]}


def run_probe(model: str, span: tuple[int, int] | None, dtype: str) -> dict[str, Any]:
    """`probe` in a fresh process with a fresh cache folder (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="meshws-memory-") as cache:
        argv = [sys.executable, "-m", "meshws.tools.memory_bench", "--probe",
                "baseline" if span is None else f"{span[0]}-{span[1]}", "--model", model, "--dtype", dtype,
                "--cache", cache]
        env = dict(os.environ, HF_HUB_OFFLINE="1", MESHWS_CACHE_DIR=cache)
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"memory probe {span} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def measure_memory(model: str, total_layers: int, dtype: str = "float32",
                   names: list[str] | None = None) -> dict[str, Any]:
    """The baseline and each named span (default: all of `spans_for`), each in a fresh process."""
    spans = spans_for(total_layers)
    names = names or list(spans)
    baseline = run_probe(model, None, dtype)
    report: dict[str, Any] = {"dtype": dtype, "baseline": baseline, "spans": {}}
    for name in names:
        report["spans"][name] = run_probe(model, spans[name], dtype)
    full = report["spans"].get("full")
    for entry in report["spans"].values():
        for kind in ("peak", "steady"):
            entry[f"{kind}_above_baseline_bytes"] = entry[f"{kind}_bytes"] - baseline[f"{kind}_bytes"]
            if full:
                entry[f"{kind}_ratio_to_full"] = round(
                    entry[f"{kind}_above_baseline_bytes"] / max(full[f"{kind}_above_baseline_bytes"], 1), 3)
    report["targets"] = {
        f"{name}_{kind}_le_{TARGETS[share]}x_full": {
            "value": entry.get(f"{kind}_ratio_to_full"),
            "met": None if full is None else entry[f"{kind}_ratio_to_full"] <= TARGETS[share]}
        for name, entry in report["spans"].items() for share in TARGETS if name.startswith(share)
        for kind in ("peak", "steady")}
    return report


def print_memory(report: dict[str, Any]) -> None:
    megabytes = 1024 * 1024  # MiB, as /proc reports kB
    base = report["baseline"]
    print(f"\n== memory ({report['dtype']}, fresh process and cache each) == baseline: peak "
          f"{base['peak_bytes'] / megabytes:.0f} MiB, steady {base['steady_bytes'] / megabytes:.0f} MiB")
    print("span        | layers  | weights MiB | start s | peak MiB (above, x full) | steady MiB (above, x full)")
    for name, entry in report["spans"].items():
        print(f"{name:<11} | {entry['layers'][0]:>2}-{entry['layers'][1] - 1:<4} | "
              f"{entry['weight_bytes'] / megabytes:11.0f} | {entry['start_s']:7.1f} | "
              f"{entry['peak_bytes'] / megabytes:6.0f} ({entry['peak_above_baseline_bytes'] / megabytes:4.0f}, "
              f"{entry.get('peak_ratio_to_full', 0):.2f}x)       | "
              f"{entry['steady_bytes'] / megabytes:6.0f} ({entry['steady_above_baseline_bytes'] / megabytes:4.0f}, "
              f"{entry.get('steady_ratio_to_full', 0):.2f}x)")
    for name, check in report["targets"].items():
        state = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        print(f"target {name}: {check['value']} -> {state}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshws.tools.memory_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--spans", nargs="+", choices=list(spans_for(3)), help="default: all")
    parser.add_argument("--out", default="bench-results/memory.json", help="where to write the JSON")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: "baseline" or "START-END" (half-open)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.probe:
        span = None if args.probe == "baseline" else tuple(int(n) for n in args.probe.split("-"))
        print(json.dumps(probe(args.model, span, args.cache, args.dtype)), flush=True)  # type: ignore[arg-type]
        return
    out = report_path(parser, args.out, "memory.json")  # (a probe writes no report)
    from ..model.source import layer_count, locate_model

    total = layer_count(locate_model(args.model))
    report = measure_memory(args.model, total, args.dtype, args.spans)
    print_memory(report)
    write_report(report, out)


def report_path(parser: argparse.ArgumentParser, out: str, name: str) -> Path:
    """Where `--out` asks for the JSON: a folder (one that exists, or ends with a slash) gets `name` in it. Its
    folder is made now, so a run that cannot write its report fails before it measures, not after."""
    folder = out.endswith(("/", os.sep)) or os.path.basename(out) in ("", ".", "..") or Path(out).is_dir()
    path = Path(out) / name if folder else Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=path.parent).close()  # a folder that exists but takes no files fails now too
    except OSError as exc:
        parser.error(f"--out {out}: cannot write there ({exc.strerror or exc})")
    return path


def write_report(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
