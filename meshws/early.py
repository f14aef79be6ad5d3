"""What a node starts before it imports torch and the rest (a second or two of one core): on a machine's first start
the kernels' compile (`kernel_build`), and on a head or full node whose model cache lacks the tokenizer, its build in
a child process (`source.build_tokenizer_early`). Both run on the other core meanwhile; the node waits for them only
where it needs their results. Only the flags that say which model, role and cache are read here (no secret files:
one may be a pipe the node reads once), and nothing more than the standard library and meshws's light modules is
imported."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Sequence

from .config import build_parser, env_name
from .model.kernels import kernel_build
from .model.source import build_tokenizer_early


def start(argv: Sequence[str]) -> None:
    kernel_build.start()
    try:  # (flags the node will refuse are left to it: it says why, once)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            flags, _ = build_parser().parse_known_args(list(argv))
    except SystemExit:
        return
    model, role, cache_dir = (getattr(flags, name) or os.environ.get(env_name(name)) or None
                              for name in ("model", "role", "cache_dir"))
    build_tokenizer_early(model, role or "full", cache_dir)
