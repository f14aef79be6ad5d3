"""The benchmark's compute figures: one decode step against the weight-bandwidth floor, and llama.cpp.

* `measure_bandwidth`: how fast this machine reads memory (GB/s), from summing a buffer
  far larger than its caches;
* `measure_decode_step`: one token through a 15-layer middle shard (no embeddings, no LM
  head), per compute path (transformers; lean, fused where meshws's kernels run it; the same
  weights op by op; op by op on OpenBLAS for fp32; int8 weights): ms per step and
  the ratio to the floor, i.e. the time to read the weights a step reads once at that bandwidth (a
  GGUF's blocks as stored), and for the lean paths one step of 16 sessions at once (`batch_ms`, and
  `batch_over_one`: its cost in lone steps; 16 would mean a wave saves nothing);
* `measure_llama_cpp`: llama.cpp (llama-cpp-python, an optional extra) on the same GGUF,
  the same prompt token ids and the same thread count: decode tok/s and time to first
  token. None when it is not installed.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory (best of `repeats` sums over a cold-sized buffer)."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best


def measure_decode_step(resolved: Any, dtype: str, bandwidth: float, steps: int = 20,
                        context: int = 64) -> dict[str, Any]:
    """ms per one-token decode step of a 15-layer middle shard, per compute path, and its ratio to the floor."""
    import torch

    from ..model.kernels.blas import choose_matmul
    from ..model.shard import ModelShard, ShardSettings
    from ..model.tensors import positions

    results: dict[str, Any] = {}
    lean = ShardSettings(dtype=dtype, compute="lean")  # fused where meshws's kernels run it, else op by op
    paths = [("transformers", ShardSettings(dtype=dtype, compute="transformers")), ("lean", lean),
             ("lean_ops", lean)]  # the same weights, the decode step op by op through torch (`fused` off)
    if resolved.gguf is None:  # a folder's float weights: int8, and op by op on OpenBLAS (a GGUF's blocks are its own)
        paths.append(("lean_int8", ShardSettings(dtype=dtype, compute="lean", quant="int8")))
        if dtype == "float32" and choose_matmul("openblas", dtype, False)[0] == "openblas":
            paths.insert(3, ("lean_openblas", ShardSettings(dtype=dtype, compute="lean", matmul="openblas")))
    for name, settings in paths:
        shard = ModelShard(resolved, 5, 20, settings)
        if name == "lean_ops" and shard.lean is not None:
            shard.lean.fused = None
        width = shard.hidden_size
        with torch.inference_mode():
            shard.layers.run(torch.randn(1, context, width, dtype=shard.compute_dtype), positions(0, context),
                             "bench", "prefill", 0)
            times = []
            for index in range(steps):
                hidden = torch.randn(1, 1, width, dtype=shard.compute_dtype)
                started = time.perf_counter()
                shard.layers.run(hidden, positions(context + index, 1), "bench", "decode", context + index)
                times.append(time.perf_counter() - started)
        shard.release_session("bench")
        step = statistics.median(times[2:])
        batch = None if shard.lean is None else _batch_step(shard, context, steps)
        floor = shard.weight_bytes / bandwidth  # (a GGUF's blocks as mapped; the transformers path's floats)
        results[name] = {"step_ms": round(step * 1e3, 2), "floor_ms": round(floor * 1e3, 2),
                         "over_floor": round(step / floor, 2), "weight_mib": round(shard.weight_bytes / 2**20, 1),
                         "path": shard.compute_path}
        if batch is not None:  # what a 16-session wave costs this shard, against 16 lone steps
            results[name].update(batch_ms=round(batch * 1e3, 2), batch_over_one=round(batch / step, 2))
    return results


def _batch_step(shard: Any, context: int, steps: int, rows: int = 16) -> float:
    """Seconds per decode step of `rows` sessions at once (`run_rows`, the path a wave takes), median."""
    import torch

    from ..model.tensors import positions

    lean, width = shard.lean, shard.hidden_size
    caches = [lean.new_cache() for _ in range(rows)]
    with torch.inference_mode():
        for row, cache in enumerate(caches):  # prompts of different lengths, as a wave's sessions have
            lean.run(torch.randn(1, context - row, width, dtype=shard.compute_dtype),
                     positions(0, context - row), cache)
        times = []
        for index in range(steps):
            hidden = torch.randn(rows, 1, width, dtype=shard.compute_dtype)
            at = torch.tensor([[context - row + index] for row in range(rows)])
            started = time.perf_counter()
            lean.run_rows(hidden, at, caches)
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def measure_llama_cpp(gguf: Path | None, prompt_ids: list[int], tokens: int) -> dict[str, Any] | None:
    """llama.cpp's greedy decode of the same prompt ids with as many threads as meshws uses; None without it."""
    if gguf is None:
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    llm.create_completion(prompt=prompt_ids, max_tokens=2, temperature=0)  # warm-up
    llm.reset()
    started = time.perf_counter()
    stamps = []
    for _ in llm.create_completion(prompt=prompt_ids, max_tokens=tokens + 1, temperature=0, stream=True,
                                   logit_bias={llm.token_eos(): -1e9}):
        stamps.append(time.perf_counter())
    ttft = stamps[0] - started
    decode = (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)
    return {"decode_tok_s": round(decode, 2), "ttft_s": round(ttft, 4), "threads": threads,
            "gguf": gguf.name}


def gguf_of(model: str) -> Path | None:
    """The GGUF file a model spec names (the embedded model's included), else None."""
    from ..model.source import embedded_gguf_path

    if model in ("embedded", "", None):
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def reference_model(resolved: Any, dtype: str) -> Any:
    """The whole model as transformers loads it (a GGUF dequantized), in `dtype` (auto: bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, "bfloat16" if dtype == "auto" else dtype)
    if resolved.gguf is not None:
        return AutoModelForCausalLM.from_pretrained(str(resolved.gguf.parent), gguf_file=resolved.gguf.name,
                                                    dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(resolved.folder), dtype=torch_dtype).eval()


def measure_generate_sessions(resolved: Any, dtype: str, prompt_ids: list[int], tokens: int,
                              counts: list[int]) -> dict[str, Any]:
    """In-process `generate()` on a batch of `count` copies of the prompt: what one process does with N at once."""
    import torch

    model = reference_model(resolved, dtype)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=2)  # warm-up
        for count in counts:
            ids = torch.tensor([prompt_ids] * count)
            started = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=1)
            ttft = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1)
            total = time.perf_counter() - started
            step = max(total - ttft, 1e-9) / tokens  # every step carries all rows: one gap per step
            results[str(count)] = {"sessions": count, "aggregate_tok_s": round(count * (tokens + 1) / total, 2),
                                   "ttft_p50_s": round(ttft, 4), "itl_p50_s": round(step, 6),
                                   "itl_p95_s": round(step, 6)}
    return results
