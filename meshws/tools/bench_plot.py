"""The benchmark's picture: aggregate tok/s and p95 inter-token latency against concurrent sessions.

One line per runner (in-process `generate()` on a batch, a `full` node, the head + tail
mesh, and that mesh with int8 weights when `--mesh-quant int8` ran it) and dtype.
matplotlib is an optional dependency (`pip install meshws[bench]`): without it the
benchmark says so and writes no picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bench_gguf import llama_beside

SERIES = (("generate_sessions", "generate()"), ("full_node_sessions", "full node"), ("mesh", "head + tail"),
          ("mesh_int8", "head + tail, int8"), ("mesh_pinned", "head + tail, a core each"),
          ("llama_cpp_sessions", "llama.cpp, as many sequences"))


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (rates, gaps) = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = set()
    for dtype, result in report["results"].items():
        for key, label in SERIES:
            data = result.get(key) or {}
            counts = sorted(int(count) for count in data)
            if not counts or (key == "llama_cpp_sessions" and key in drawn):  # (its own dtype: drawn once)
                continue
            drawn.add(key)
            style = "-" if dtype == "float32" else "--"
            name = label if key == "llama_cpp_sessions" else f"{label}, {dtype}"
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


def write_gguf_plot(sections: list[dict[str, Any]], path: Path) -> Path | None:
    """GGUF sections (one per file) as grouped bars: meshws's figures over llama.cpp's (1.0 = the same), one group
    per figure, one bar per file; black ticks are the targets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sections = [section for section in sections if section.get("llama_cpp")]
    if not sections:
        return None
    names = ["decode, full node", "decode, split", "prompt, full node", "peak memory, full node",
             "peak memory, each split node"]
    targets = [1.0, 0.9, 0.7, 1.15, None]
    figure, axes = plt.subplots(figsize=(8.5, 1.2 + 0.55 * len(names) * max(1, len(sections)) ** 0.6))
    height = 0.8 / len(sections)
    for index, section in enumerate(sections):
        llama, full, mesh = section["llama_cpp"], section["full"], section["mesh"]
        values = [full["decode_tok_s"] / llama_beside(full, llama), mesh["decode_tok_s"] / llama_beside(mesh, llama),
                  llama["prompt_s"] / full["prompt_s"], full["peak_bytes"] / llama["peak_bytes"],
                  max(mesh["peak_bytes"]) / llama["peak_bytes"]]
        rows = [row - 0.4 + height * (index + 0.5) for row in range(len(names))]
        parts = len(mesh["peak_bytes"])
        axes.barh(rows, values, height=height * 0.9, label=f"{section['file']} ({parts}-node split)")
        for row, value in zip(rows, values):
            axes.text(value, row, f" {value:.2f}x", va="center", fontsize=7)
        share = {2: 0.65, 3: 0.4}.get(parts)  # each split node's target: its own tick
        if share:
            axes.plot([share, share], [rows[-1] - height / 2, rows[-1] + height / 2], color="black", linewidth=1.5)
    for row, target in enumerate(targets):
        if target is not None:
            axes.plot([target, target], [row - 0.45, row + 0.45], color="black", linewidth=1.5)
    axes.set_yticks(range(len(names)), names)
    axes.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.invert_yaxis()
    axes.legend(fontsize=7, loc="lower right")
    axes.set_xlabel("meshws / llama.cpp, same file and threads (speed: higher is better; memory: lower)")
    axes.set_title(f"{sections[0]['threads']} threads (python -m meshws.bench --model FILE.gguf)", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m meshws.tools.bench_plot OUT.png RESULT.json ...`: one picture of several GGUF runs' sections."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m meshws.tools.bench_plot", description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("results", nargs="+", type=Path, help="JSON files `python -m meshws.bench --out` wrote")
    args = parser.parse_args(argv)
    sections = [json.loads(result.read_text())["gguf"] for result in args.results]
    if write_gguf_plot(sections, args.out) is None:
        raise SystemExit("no picture: matplotlib is missing, or no run had llama.cpp beside it")
    print(args.out)


if __name__ == "__main__":
    main()
