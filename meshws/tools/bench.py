"""`python -m meshws.bench`: how fast meshws is, as ratios to llama.cpp and to in-process `generate()` in the same run.

`python -m meshws.bench --model FILE.gguf` measures a GGUF of any size beside llama.cpp on the same file (`bench_gguf`):
a full node's decode, prompt, peak memory, start and bytes written; a head + tail's memory per node and decode.
On the embedded model (the default) that section runs first, then for each dtype it measures:
  * in-process `model.generate()` on the whole model (the baseline);
  * a `full` node process (one machine, zero hops) through the OpenAI API, with float and
    with `--quant int8` weights;
  * a head + tail mesh on loopback at 1, 4 and 16 concurrent sessions: decode tokens/s
    per session, aggregate tokens/s, time to first token (p50, p95);
  * bytes per decode and per prefill frame (from the tail's metrics);
  * a cached decode step vs a stateless one (the whole context re-run) at several
    context lengths, in-process;
  * one decode step of a 15-layer shard per compute path, against the time to read its
    weights once at this machine's measured memory bandwidth (`bench_compute`);
  * llama.cpp on the same GGUF and thread count, when llama-cpp-python is installed (an optional extra):
    every decode figure is then also a ratio to it, and at each session count its own batched
    decoding of that many sequences stands beside the mesh's aggregate (`bench_llama`);
  * a six-turn conversation with a ~500-token system prompt: time to first token of
    turns 2-6 with the session reused (/ws/chat; the OpenAI API's warm pool) over the
    same turns prefilled in full (`bench_turns`);
  * speculative decoding: tokens per lap and time per token with prompt-lookup drafts over
    none, through a relay delaying each way by 25 ms and on loopback (`bench_laps`);
  * memory: peak and steady resident memory of a node holding all, half or a third of
    the layers, each a fresh process with a fresh cache (`memory_bench`; off with --short).
It prints a table and writes JSON. Timing on shared machines is noisy: compare the
ratios, and rerun before believing a small difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from .bench_compute import (gguf_of, measure_bandwidth, measure_decode_step, measure_generate_sessions,
                            measure_llama_cpp)
from .bench_gguf import measure_gguf, print_gguf
from .bench_plot import write_gguf_plot, write_plot
from .bench_kv import add_kv_arguments, run_kv_suite
from .bench_scale import run_scale_suite
from .bench_standby import add_standby_arguments, run_standby_suite
from .bench_laps import measure_laps
from .bench_llama import measure_llama_cpp_sessions
from .bench_nodes import measure_processes
from .bench_placement import add_placement_arguments
from .bench_turns import measure_conversation
from .local_mesh import tail_start
from .memory_bench import measure_memory, print_memory, report_path, write_report

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
MODEL_ENV = {"HF_HUB_OFFLINE": "1"}


# -- in-process measurements ---------------------------------------------------


def measure_generate(resolved: Any, dtype: str, prompt_ids: list[int], tokens: int) -> dict[str, float]:
    """One sequence through in-process `generate()`: decode tok/s and time to first token (the baseline)."""
    one = measure_generate_sessions(resolved, dtype, prompt_ids, tokens, [1])["1"]
    return {"decode_tok_s": round(1 / one["itl_p50_s"], 2), "ttft_s": one["ttft_p50_s"]}


def measure_cached_vs_stateless(resolved: Any, dtype: str, contexts: list[int], repeats: int) -> dict[str, Any]:
    import torch

    from ..model.shard import ModelShard, ShardSettings

    shard = ModelShard(resolved, 0, None, ShardSettings(dtype=dtype))
    results: dict[str, Any] = {}
    for context in contexts:
        ids = [int(i) for i in torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(0))]
        shard.encode_prompt(ids, session_id="bench")
        cached, stateless = [], []
        for index in range(repeats):
            started = time.perf_counter()
            shard.encode_next_token(ids[index], "bench")
            cached.append(time.perf_counter() - started)
            if index < max(1, repeats * 256 // context):  # long stateless steps take seconds: fewer of them
                started = time.perf_counter()
                shard.encode_prompt(ids + ids[: index + 1])  # no session: the whole context again
                stateless.append(time.perf_counter() - started)
        shard.release_session("bench")
        c, s = statistics.median(cached), statistics.median(stateless)
        results[str(context)] = {"cached_step_s": round(c, 5), "stateless_step_s": round(s, 5),
                                 "stateless_over_cached": round(s / c, 2)}
    return results


# -- the report -------------------------------------------------------------------


def add_ratios(result: dict[str, Any]) -> None:
    base = result["generate"]["decode_tok_s"]
    for name in ("full_node", "full_node_int8"):
        if name in result:
            result[name]["ratio_to_generate"] = round(result[name]["per_session_tok_s"] / base, 3)
    for series in mesh_series(result):
        one = result[series].get("1", {}).get("aggregate_tok_s")
        for entry in result[series].values():
            entry["per_session_ratio_to_generate"] = round(entry["per_session_tok_s"] / base, 3)
            entry["aggregate_ratio_to_generate"] = round(entry["aggregate_tok_s"] / base, 3)
            if one:
                entry["aggregate_over_one_session"] = round(entry["aggregate_tok_s"] / one, 3)
    llama = result.get("llama_cpp")
    if llama:
        cpp = llama["decode_tok_s"]
        result["generate"]["ratio_to_llama_cpp"] = round(base / cpp, 3)
        for name in ("full_node", "full_node_int8"):
            if name in result:
                result[name]["ratio_to_llama_cpp"] = round(result[name]["per_session_tok_s"] / cpp, 3)
        sequences = result.get("llama_cpp_sessions") or {}
        for entry in (entry for series in mesh_series(result) for entry in result[series].values()):
            entry["per_session_ratio_to_llama_cpp"] = round(entry["per_session_tok_s"] / cpp, 3)
            entry["aggregate_ratio_to_llama_cpp"] = round(entry["aggregate_tok_s"] / cpp, 3)
            entry["aggregate_ratio_to_llama_cpp_sequences"] = _over(  # (its batched decoding of as many sequences)
                entry["aggregate_tok_s"], sequences.get(str(entry.get("sessions")), {}).get("aggregate_tok_s"))


def mesh_series(result: dict[str, Any]) -> list[str]:
    """The head + tail series measured: `mesh` (float weights), `mesh_int8` (`--mesh-quant int8`), `mesh_pinned`
    (`--pin`)."""
    return [key for key in result if key == "mesh" or key.startswith("mesh_")]


def _over(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value and base else None


def targets(result: dict[str, Any]) -> dict[str, Any]:
    mesh, spec = result.get("mesh", {}), result.get("speculation", {})
    checks = {
        "mesh_one_session_ge_1x_generate": mesh.get("1", {}).get("per_session_ratio_to_generate"),
        "mesh_16_sessions_ge_6x_one": mesh.get("16", {}).get("aggregate_over_one_session"),
        "decode_frame_le_1400_bytes": result.get("wire", {}).get("decode_frame_bytes"),
        "cached_ge_15x_stateless_at_1024": result["stateless"].get("1024", {}).get("stateless_over_cached"),
        "full_node_ge_2x_generate": result["full_node"].get("ratio_to_generate"),
        "full_node_int8_ge_3x_generate": result.get("full_node_int8", {}).get("ratio_to_generate"),
        "mesh_one_session_ge_1_5x_generate": mesh.get("1", {}).get("per_session_ratio_to_generate"),
        "full_node_ge_0_5x_llama_cpp": result["full_node"].get("ratio_to_llama_cpp"),
        "mesh_16_ge_1_5x_generate_16": _over(mesh.get("16", {}).get("aggregate_tok_s"),
                                             result.get("generate_sessions", {}).get("16", {}).get("aggregate_tok_s")),
        "mesh_16_ge_1x_llama_cpp_16": _over(mesh.get("16", {}).get("aggregate_tok_s"), (
            result.get("llama_cpp_sessions") or {}).get("16", {}).get("aggregate_tok_s")),
        "mesh_16_p95_itl_le_3x_one": _over(mesh.get("16", {}).get("itl_p95_s"), mesh.get("1", {}).get("itl_p95_s")),
        "joining_ttft_le_2x_idle": _over(result.get("joining", {}).get("ttft_s"), mesh.get("1", {}).get("ttft_p50_s")),
        **{f"conversation_{name}_ttft_le_0_3x_fresh": result.get("conversation", {}).get(name, {}).get(
            "later_turns_ttft_ratio") for name in ("ws_chat", "openai_api")},
        "drafts_delayed_repeat_ge_2_tokens_per_lap": spec.get("delayed_repeat_ngram", {}).get("tokens_per_lap"),
        "drafts_delayed_repeat_time_le_0_55x_none": spec.get("delayed_repeat_time_ratio"),
        "drafts_delayed_ordinary_time_le_1_05x_none": spec.get("delayed_ordinary_time_ratio"),
        "drafts_loopback_ordinary_time_le_1x_none": spec.get("loopback_ordinary_time_ratio"),
    }
    limits = {"mesh_one_session_ge_1x_generate": 1.0, "mesh_16_sessions_ge_6x_one": 6.0,
              "decode_frame_le_1400_bytes": 1400, "cached_ge_15x_stateless_at_1024": 15.0,
              "full_node_ge_2x_generate": 2.0, "full_node_int8_ge_3x_generate": 3.0,
              "mesh_one_session_ge_1_5x_generate": 1.5, "full_node_ge_0_5x_llama_cpp": 0.5,
              "mesh_16_ge_1_5x_generate_16": 1.5, "mesh_16_ge_1x_llama_cpp_16": 1.0,
              "mesh_16_p95_itl_le_3x_one": 3.0, "joining_ttft_le_2x_idle": 2.0,
              "conversation_ws_chat_ttft_le_0_3x_fresh": 0.3, "conversation_openai_api_ttft_le_0_3x_fresh": 0.3,
              "drafts_delayed_repeat_ge_2_tokens_per_lap": 2.0, "drafts_delayed_repeat_time_le_0_55x_none": 0.55,
              "drafts_delayed_ordinary_time_le_1_05x_none": 1.05, "drafts_loopback_ordinary_time_le_1x_none": 1.0}
    report = {}
    for name, value in checks.items():
        if value is None:
            report[name] = {"value": None, "met": None}
        elif "_le_" in name:
            report[name] = {"value": value, "met": value <= limits[name]}
        else:
            report[name] = {"value": value, "met": value >= limits[name]}
    return report


def print_table(report: dict[str, Any]) -> None:
    for dtype, result in report["results"].items():
        base = result["generate"]
        print(f"\n== {dtype} == generate(): {base['decode_tok_s']} tok/s decode, ttft {base['ttft_s'] * 1000:.0f} ms")
        llama = result.get("llama_cpp")
        if llama:
            print(f"llama.cpp          : {llama['decode_tok_s']:7.2f} tok/s  ({llama['threads']} threads, "
                  f"ttft {llama['ttft_s'] * 1000:.0f} ms; generate() is {base['ratio_to_llama_cpp']:.2f}x of it)")
        for name, label in (("full_node", "full node         "), ("full_node_int8", "full node, int8   ")):
            if name not in result:
                continue
            full = result[name]
            cpp = f", {full['ratio_to_llama_cpp']:.2f}x llama.cpp" if "ratio_to_llama_cpp" in full else ""
            print(f"{label} : {full['per_session_tok_s']:7.2f} tok/s  ({full['ratio_to_generate']:.2f}x generate{cpp})")
        for name, step in result["decode_step"].items():
            print(f"15-layer decode step, {step['path']:<30}: {step['step_ms']:6.2f} ms = {step['over_floor']:.2f}x "
                  f"the {step['floor_ms']:.2f} ms floor ({step['weight_mib']} MiB at {report['bandwidth_gb_s']} GB/s)"
                  + (f"; 16 rows {step['batch_ms']:.2f} ms = {step['batch_over_one']:.2f} steps"
                     if "batch_ms" in step else ""))
        for series in mesh_series(result):
            print(f"{series.replace('_', ' ')} sessions | tok/s per session (x gen) | aggregate tok/s (x gen, x one) | "
                  "ttft p50 / p95 | inter-token p50 / p95 | busy head / tail")
            for count, entry in result[series].items():
                busy = entry.get("busy_fraction", {})
                print(f"  {count:>11} | {entry['per_session_tok_s']:8.2f} "
                      f"({entry['per_session_ratio_to_generate']:.2f}x)          | {entry['aggregate_tok_s']:8.2f} "
                      f"({entry['aggregate_ratio_to_generate']:.2f}x, "
                      f"{entry.get('aggregate_over_one_session', 0):.2f}x)"
                      f"      | {entry['ttft_p50_s'] * 1000:.0f} / {entry['ttft_p95_s'] * 1000:.0f} ms | "
                      f"{entry['itl_p50_s'] * 1000:.0f} / {entry['itl_p95_s'] * 1000:.0f} ms | "
                      f"{busy.get('head', 0):.2f} / {busy.get('tail', 0):.2f}")
        for key, label in (("generate_sessions", "generate() batch"), ("full_node_sessions", "full node"),
                           ("llama_cpp_sessions", "llama.cpp seqs")):
            print(f"{label:<17}: " + ", ".join(f"{count}: {entry['aggregate_tok_s']:.1f} tok/s "
                                              f"(p95 gap {entry['itl_p95_s'] * 1000:.0f} ms)"
                                              for count, entry in (result.get(key) or {}).items()))
        joining = result.get("joining")
        if joining:
            print(f"a session joining {joining['busy_sessions']} busy ones: first token after "
                  f"{joining['ttft_s'] * 1000:.0f} ms")
        for name, turns in result.get("conversation", {}).items():
            if isinstance(turns, dict):
                print(f"conversation over {name}: ttft per turn reused " + " ".join(
                    f"{t * 1000:.0f}" for t in turns["ttft_reuse_s"]) + " ms, fresh " + " ".join(
                    f"{t * 1000:.0f}" for t in turns["ttft_fresh_s"]) + f" ms; later turns "
                    f"{turns['later_turns_ttft_ratio']:.2f}x; cached tokens {turns['cached_tokens']}")
        spec = result.get("speculation")
        if spec:
            times = {key[:-11].replace("_", " "): ratio for key, ratio in spec.items() if key.endswith("time_ratio")}
            print("drafts vs none, time per token: " + ", ".join(f"{key} {ratio:.2f}x" for key, ratio in times.items())
                + f"; tokens per lap (delayed, repeat) {spec['delayed_repeat_ngram']['tokens_per_lap']}")
        wire = result["wire"]
        print(f"frames: decode {wire.get('decode_frame_bytes')} B, prefill {wire.get('prefill_frame_bytes')} B")
        for context, entry in result["stateless"].items():
            print(f"context {context:>5}: cached step {entry['cached_step_s'] * 1000:.1f} ms, stateless "
                  f"{entry['stateless_step_s'] * 1000:.1f} ms ({entry['stateless_over_cached']}x)")
        for name, check in result["targets"].items():
            state = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
            print(f"target {name}: {check['value']} -> {state}")


def main(argv: list[str] | None = None, prog: str = "python -m meshws.bench") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="the embedded model, or a GGUF file (its own section "
                        "only, unless --suite all)")
    parser.add_argument("--suite", default="auto",
                        choices=("auto", "all", "gguf", "placement", "kv", "standby", "scale"),
                        help="gguf: the GGUF section; all: every section; auto: all on the embedded model, gguf on "
                        "another file; placement: `bench_placement` (root, cgroup v1); kv, standby, scale: "
                        "`bench_kv`, `bench_standby`, `bench_scale`")
    add_placement_arguments(parser), add_kv_arguments(parser), add_standby_arguments(parser)
    parser.add_argument("--dtype", nargs="+", default=["auto", "float32"], choices=("auto", "bfloat16", "float32"),
                        help="auto: a GGUF's blocks with 8-bit activations (the nodes' default); float32: exact")
    parser.add_argument("--sessions", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--mesh-quant", nargs="+", default=["none"], choices=("none", "int8"),
                        help="weights of the head + tail mesh runs: none (float), int8, or both (default none)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per session")
    parser.add_argument("--contexts", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=4, help="steps timed per context length")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs per session count on nodes, each figure their median (default 3; 1 if --short)")
    parser.add_argument("--short", action="store_true", help="a quick run (CI): few tokens and repeats, no memory")
    parser.add_argument("--pin", action="store_true",
                        help="also measure the head + tail with each node on a core of its own (taskset)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="measure memory per span in fresh processes (default: on unless --short)")
    parser.add_argument("--parts", type=int, default=2, choices=range(2, 9), metavar="N",
                        help="GGUF section: the split mesh's nodes (2: head + tail; 3: head + middle + tail ...)")
    parser.add_argument("--out", default="bench-results/bench.json", help="where to write the JSON")
    parser.add_argument("--tls", action="store_true", help="also measure a head + tail over wss:// (needs trustme)")
    parser.add_argument("--link-delay", nargs=2, type=float, default=[25.0, 25.0], metavar=("TO_TAIL_MS", "TO_HEAD_MS"),
                        help="the speculation scenario's delayed link, each direction (default 25 25)")
    args = parser.parse_args(argv)
    out = report_path(parser, args.out, "bench.json")
    if args.short:
        args.tokens, args.repeats = min(args.tokens, 4), 1
    args.runs = max(1, args.runs or (1 if args.short else 3))
    os.environ.update(MODEL_ENV)
    gguf = gguf_of(args.model)
    suite = args.suite if args.suite != "auto" else "all" if args.model in ("embedded", "") or gguf is None else "gguf"
    gguf_section = None
    if suite in ("kv", "standby", "scale"):
        return {"kv": run_kv_suite, "standby": run_standby_suite, "scale": run_scale_suite}[suite](args, gguf, out)
    if gguf is not None and suite != "placement":
        gguf_section = measure_gguf(gguf, 16 if args.short else 64, parts=args.parts)
        print_gguf(gguf_section)
        if suite == "gguf":
            report = {"model": gguf.stem, "gguf": gguf_section}
            plot = write_gguf_plot([gguf_section], out.with_suffix(".png"))
            report["plot"] = str(plot) if plot else None
            write_report(report, out)
            return

    import torch

    from ..model.kernels import blas
    from ..model.source import load_tokenizer, model_shape, resolve_model

    resolved = resolve_model(args.model, os.environ.get("MESHWS_CACHE_DIR"), tokenizer=True)
    args.gguf = resolved.gguf is not None
    shape = model_shape(resolved)
    args.layers, args.tail_start = shape["layers"], tail_start(shape)
    tokenizer = load_tokenizer(resolved)
    if tokenizer.chat_template:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    else:
        prompt_ids = tokenizer(PROMPT)["input_ids"]
    if suite == "placement":
        from .bench_placement import run_placement, write_placement_plot

        section = run_placement(str(gguf or resolved.gguf), prompt_ids, resolved.model_id, args.node_memory,
                                args.slow_share, args.tokens, args.long_tokens, args.chains, out.parent / "logs")
        plot = write_placement_plot(section, out.with_suffix(".png"))
        write_report({"model": resolved.model_id, "placement": section, "plot": str(plot) if plot else None}, out)
        print(json.dumps(section["targets"], indent=1))
        return
    report: dict[str, Any] = {
        "model": resolved.model_id, "gguf": gguf_section,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": {"tokens": args.tokens, "sessions": args.sessions, "contexts": args.contexts,
                     "repeats": args.repeats, "prompt_tokens": len(prompt_ids)},
        "results": {},
    }
    bandwidth = measure_bandwidth()
    report["bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    llama = measure_llama_cpp(gguf_of(args.model), prompt_ids, args.tokens)
    llama_sessions = measure_llama_cpp_sessions(gguf_of(args.model), prompt_ids, args.tokens, args.sessions)
    threads = torch.get_num_threads()
    for dtype in args.dtype:
        print(f"measuring {dtype} ...", flush=True)
        blas.take_threads("torch", "generate() multiplies with torch", threads)  # an earlier shard may hold them
        result: dict[str, Any] = {"generate": measure_generate(resolved, dtype, prompt_ids, args.tokens),
                                  "generate_sessions": measure_generate_sessions(resolved, dtype, prompt_ids,
                                                                                 args.tokens, args.sessions),
                                  "llama_cpp": llama, "llama_cpp_sessions": llama_sessions,
                                  "decode_step": measure_decode_step(resolved, dtype, bandwidth)}
        result.update(measure_processes(args, dtype, prompt_ids, resolved.model_id))
        result["conversation"] = measure_conversation(args.model, args.layers, dtype, resolved.model_id,
                                                      args.tokens, 2 if args.short else 6)
        result["speculation"] = measure_laps(args.model, args.layers, dtype, resolved.model_id,
                                             16 if args.short else 64, tokenizer,
                                             ("delayed",) if args.short else ("delayed", "loopback"),
                                             (args.link_delay[0] / 1000, args.link_delay[1] / 1000))
        result["stateless"] = measure_cached_vs_stateless(resolved, dtype, args.contexts, args.repeats)
        if args.tls:
            from .bench_tls import measure_tls

            result["tls"] = measure_tls(args, dtype, prompt_ids, resolved.model_id)
            print(f"{dtype} one session over TLS: {result['tls']}", flush=True)
        add_ratios(result)
        result["targets"] = targets(result)
        report["results"][dtype] = result
    plot = write_plot(report, out.with_stem(out.stem + "-plot") if out.suffix == ".png" else out.with_suffix(".png"))
    report["plot"] = str(plot) if plot else None
    print_table(report)
    print(f"plot: {plot}" if plot else "no plot: matplotlib is not installed (pip install meshws[bench])")
    if args.memory if args.memory is not None else not args.short:
        print("measuring memory per span (fresh processes and caches) ...", flush=True)
        report["memory"] = measure_memory(args.model, args.layers)
        print_memory(report["memory"])
    write_report(report, out)


if __name__ == "__main__":
    main()
