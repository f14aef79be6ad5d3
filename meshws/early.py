"""What a node starts before it imports torch and the rest (a second or two of one core): on a machine's first start
the kernels' compile (`kernel_build`), and on a head or full node whose model cache lacks the tokenizer, its build in
a child process (`source.build_tokenizer_early`). Both run on the other core meanwhile; the node waits for them only
where it needs their results. Nothing here imports more than the standard library and meshws's light modules."""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

from .config import parse_settings
from .model import kernel_build
from .model.source import build_tokenizer_early


def start(argv: Sequence[str]) -> None:
    kernel_build.start()
    try:  # (flags the node will refuse are left to it: it says why, once)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            settings = parse_settings(argv)
    except SystemExit:
        return
    build_tokenizer_early(settings.model, settings.role, settings.cache_dir)
