"""`--compile`: the lean path's layer pieces through `torch.compile`, compiled at start.

Only the pieces around attention are compiled (norms, projections, rotary, MLP,
residuals); attention and the in-place cache writes stay eager. The same two graphs
serve every layer (the weights are inputs, not constants) and any number of rows or
positions (dynamic shapes). Inductor's caches live in the model cache folder, so a
restarted node loads its compiled code instead of compiling again.

Measured on a 2-core AVX2 machine (SmolLM2-135M, fp32, full node): 57 s to compile, 11 s
on a restart with the cache; decode 10.6-10.9 tok/s compiled against 11.2-11.8 eager,
and with (then weight-only) int8 weights 21-23 tok/s both ways. A decode step there is bound
by reading the weights, not by the operations compilation fuses: hence off by default.
FBGEMM's int8 product stays outside the graphs (`packed._int8_linear`); the fused norms
round differently, so compiled int8 output parts from eager int8 after a few tokens.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .gguf.model_files import default_cache_dir
from .tensors import positions

log = logging.getLogger("meshws.shard")

OPAQUE = ("_block_linear", "_native_linear", "_int8_linear")  # `packed`'s products that graphs call, not trace


def compile_lean(shard: Any, cache_dir: Path | str | None) -> float:
    """Compile `shard`'s lean path now (a prefill, a decode step, a batch of two); the seconds it took."""
    lean = shard.lean
    if lean is None:
        raise ValueError("--compile needs the lean path")
    from .kernels import packed

    for name in OPAQUE:  # ctypes calls and FBGEMM's op: opaque to inductor (the row scaling rounds as eagerly)
        function = getattr(packed, name)
        if not getattr(function, "_torchdynamo_disable", False):
            setattr(packed, name, torch.compiler.disable(function))
    root = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "inductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root))
    lean.fused = None  # decode steps too run through the compiled pieces
    lean._before = torch.compile(lean._before_attention, dynamic=True)
    lean._after = torch.compile(lean._after_attention, dynamic=True)
    lean.compiled = True
    started = time.monotonic()
    sessions = ("compile-a", "compile-b")
    with torch.inference_mode():
        for count, mode, past in ((3, "prefill", 0), (1, "decode", 3)):
            hidden = torch.zeros(1, count, shard.hidden_size, dtype=shard.compute_dtype)
            for session in sessions:
                shard.layers.run(hidden, positions(past, count), session, mode, past)
        rows = torch.zeros(2, 1, shard.hidden_size, dtype=shard.compute_dtype)
        lean.run_rows(rows, torch.tensor([[4], [4]]), [shard.sessions.lookup(session).cache for session in sessions])
    for session in sessions:
        shard.sessions.drop(session)
    seconds = time.monotonic() - started
    log.info("compiled the lean path in %.1f s (cache %s)", seconds, os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return seconds
