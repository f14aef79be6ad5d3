"""llama.cpp decoding several sequences at once, as its `parallel` example does: the baseline for many sessions.

One context holds every sequence (`n_seq_max`, one unified KV cache); the prompts go in as one
batch, then each step is one batch of one token per sequence, greedy. That is llama.cpp's own
batched decoding on the same GGUF and thread count, with no HTTP or streaming in the way: the
fairest thing to set beside a mesh's aggregate rate. Through llama-cpp-python's low-level API
(an optional extra): None without it. The context keeps llama.cpp's own default attention (flash
attention on this CPU), where `Llama` objects (`measure_llama_cpp`) turn it off: a lone sequence's
64 greedy tokens equal `create_completion`'s with `flash_attn=True`, and without it part ways at a
near tie (token 23 of the bench prompt on the embedded model). Checked by hand.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def measure_llama_cpp_sessions(gguf: Path | None, prompt_ids: list[int], tokens: int,
                               counts: list[int], threads: int | None = None) -> dict[str, Any] | None:
    """Per sequence count: decode tok/s of all sequences together, the batched prompt's time, and a step's time
    (`threads`: default every core)."""
    if gguf is None or tokens < 2:
        return None
    try:
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr
    except ImportError:
        return None
    threads = threads or os.cpu_count() or 1
    with suppress_stdout_stderr(disable=False):  # (llama.cpp logs every context it makes)
        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not model:
            return None
        width = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        try:
            return {str(count): _sequences(llama_cpp, model, width, prompt_ids, tokens, count, threads)
                    for count in counts}
        finally:
            llama_cpp.llama_model_free(model)


def _sequences(llama_cpp: Any, model: Any, width: int, prompt_ids: list[int], tokens: int, count: int,
               threads: int) -> dict[str, Any]:
    import numpy

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = count * (len(prompt_ids) + tokens + 8)
    params.n_batch = params.n_ubatch = max(count * len(prompt_ids), 512)
    params.n_seq_max, params.kv_unified = count, True
    params.n_threads = params.n_threads_batch = threads
    context = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    try:
        def step(items: list[tuple[int, int, int, bool]]) -> list[int]:
            """One llama_decode of (token, position, sequence, wants logits): the greedy next token of each wanted."""
            batch.n_tokens = len(items)
            for i, (token, position, sequence, wanted) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
                batch.seq_id[i][0], batch.logits[i] = sequence, wanted
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return [int(numpy.argmax(numpy.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), (width,))))
                    for i, item in enumerate(items) if item[3]]

        started = time.perf_counter()
        last = len(prompt_ids) - 1
        following = step([(token, at, sequence, at == last) for sequence in range(count)
                          for at, token in enumerate(prompt_ids)])
        prompt_s = time.perf_counter() - started
        started = time.perf_counter()
        for at in range(len(prompt_ids), len(prompt_ids) + tokens - 1):
            following = step([(following[sequence], at, sequence, True) for sequence in range(count)])
        decode_s = time.perf_counter() - started
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
    step_s = round(decode_s / (tokens - 1), 6)  # every step carries all sequences: one gap per step
    return {"sessions": count, "aggregate_tok_s": round(count * (tokens - 1) / decode_s, 2),
            "prompts_s": round(prompt_s, 4), "itl_p50_s": step_s, "itl_p95_s": step_s, "threads": threads}
