"""The benchmark's picture: aggregate tok/s and p95 inter-token latency against concurrent sessions.

One line per runner (in-process `generate()` on a batch, a `full` node, the head + tail
mesh, and that mesh with int8 weights when `--mesh-quant int8` ran it) and dtype.
matplotlib is an optional dependency (`pip install meshws[bench]`): without it the
benchmark says so and writes no picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SERIES = (("generate_sessions", "generate()"), ("full_node_sessions", "full node"), ("mesh", "head + tail"),
          ("mesh_int8", "head + tail, int8"))


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (rates, gaps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dtype, result in report["results"].items():
        for key, label in SERIES:
            data = result.get(key) or {}
            counts = sorted(int(count) for count in data)
            if not counts:
                continue
            style = "-" if dtype == "float32" else "--"
            name = f"{label}, {dtype}"
            rates.plot(counts, [data[str(c)]["aggregate_tok_s"] for c in counts], style, marker="o", label=name)
            gaps.plot(counts, [data[str(c)]["itl_p95_s"] * 1000 for c in counts], style, marker="o", label=name)
    for axes, title in ((rates, "aggregate tokens/s"), (gaps, "p95 inter-token latency (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent sessions")
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
    rates.legend(fontsize=7)
    figure.suptitle(f"{report['model']} on {report['machine']['cpus']} cores (python -m meshws.bench)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_gguf_plot(section: dict[str, Any], path: Path) -> Path | None:
    """The GGUF section as bars: meshws's figures over llama.cpp's (1.0 = the same), one bar per figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    llama = section.get("llama_cpp")
    if not llama:
        return None
    full, mesh = section["full"], section["mesh"]
    bars = [("decode, full node", full["decode_tok_s"] / llama["decode_tok_s"], 1.0),
            ("decode, head + tail", mesh["decode_tok_s"] / llama["decode_tok_s"], 0.9),
            (f"{section['prompt_tokens']}-token prompt", llama["prompt_s"] / full["prompt_s"], 0.7),
            ("peak memory, full node", full["peak_bytes"] / llama["peak_bytes"], 1.15),
            ("peak memory, each half", max(mesh["peak_bytes"]) / llama["peak_bytes"], 0.65)]
    figure, axes = plt.subplots(figsize=(8, 3.6))
    names = [name for name, _, _ in bars]
    axes.barh(names, [value for _, value, _ in bars], color=["#4c72b0", "#4c72b0", "#4c72b0", "#dd8452", "#dd8452"])
    for row, (_, value, target) in enumerate(bars):
        axes.plot([target, target], [row - 0.4, row + 0.4], color="black", linewidth=1.5)
        axes.text(value, row, f" {value:.2f}x", va="center", fontsize=8)
    axes.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.invert_yaxis()
    axes.set_xlabel("meshws / llama.cpp (speed: higher is better; memory: lower; black ticks: the targets)")
    axes.set_title(f"{section['file']} on {section['threads']} threads (python -m meshws.bench --model ...)", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
