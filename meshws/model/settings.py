"""What a shard is asked to be: its layer range (`ShardLayout`) and how it computes (`ShardSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .kernels.cpu import choose_dtype
from .tensors import TORCH_DTYPES


@dataclass(frozen=True)
class ShardLayout:
    total_layers: int
    start: int
    end: int

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.total_layers


@dataclass(frozen=True)
class ShardSettings:
    dtype: str = "float32"  # compute dtype: float32, bfloat16 or auto (`cpu.choose_dtype`)
    wire_dtype: str = "auto"  # dtype of hidden states sent to the next hop; auto: see `wire_for`
    max_sessions: int = 64  # KV caches held at once (LRU beyond)
    cache_ttl: float = 600.0  # seconds an idle session's cache is kept
    ctx_size: int | None = None  # the most positions one session may hold; None: the model's context length
    kv_dtype: str = "auto"  # keys and values: auto (bf16 under 8-bit activations, else float32), float32, bf16, q8_0
    max_cache_bytes: int | None = None  # byte budget for all KV caches (LRU beyond); None: sized from free memory
    memory: int | None = None  # bytes of weights and KV caches this node may hold: KV gets what the weights leave
    threads: int | None = None  # torch intra-op threads; None = torch's default
    compute: str = "auto"  # "lean" (packed weights, `lean`), "transformers", or "auto": lean where it exists
    quant: str | None = None  # "int8": int8 linear weights (needs the lean path); None or "none": float
    compile: bool = False  # run the lean path's layer pieces through torch.compile (warmed up at start)
    matmul: str = "auto"  # float32 products on "torch", "openblas", or "auto" (`blas.choose_matmul`)
    dtype_was_auto: bool = False  # set by `checked`: the dtype was chosen for this CPU

    def checked(self) -> tuple["ShardSettings", str]:
        """These settings validated, with an `auto` dtype and a "none" quant made concrete; and why that dtype."""
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16 or auto, not {self.dtype!r}")
        if self.wire_dtype != "auto" and self.wire_dtype not in TORCH_DTYPES:
            raise ValueError(f"wire dtype must be auto or one of {sorted(TORCH_DTYPES)}")
        if self.compute not in ("auto", "lean", "transformers"):
            raise ValueError(f"compute must be auto, lean or transformers, not {self.compute!r}")
        if self.quant not in (None, "none", "int8"):
            raise ValueError(f"quant must be int8 or none, not {self.quant!r}")
        if self.kv_dtype not in ("auto", "float32", "bfloat16", "q8_0"):
            raise ValueError(f"kv dtype must be auto, float32, bfloat16 or q8_0, not {self.kv_dtype!r}")
        if self.matmul not in ("auto", "torch", "openblas"):
            raise ValueError(f"matmul must be auto, torch or openblas, not {self.matmul!r}")
        dtype, reason = choose_dtype(self.dtype)
        quant = None if self.quant == "none" else self.quant
        return replace(self, dtype=dtype, quant=quant, dtype_was_auto=self.dtype == "auto",
                       wire_dtype=wire_for(self.wire_dtype, self.dtype)), reason


def wire_for(wire_dtype: str, requested_dtype: str) -> str:
    """The wire dtype `auto` stands for: float32 where the node was asked to compute exactly in float32, so a
    split mesh answers as one machine does; else bfloat16, which loses less than 8-bit activations or bf16
    compute lose already and halves a prefill's bytes."""
    if wire_dtype != "auto":
        return wire_dtype
    return "float32" if requested_dtype == "float32" else "bfloat16"
