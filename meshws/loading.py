"""What a node serves: its shard, loaded from the node's settings, and whether its layers fit its role."""

from __future__ import annotations

from .config import NodeSettings
from .model.backend import ShardBackend


def load_backend(settings: NodeSettings, threads: int | None = None,
                 span: tuple[int, int] | None = None) -> ShardBackend:
    """The shard of `span` (else --layers; all layers when they say none)."""
    from .model.shard import ModelShard, ShardSettings

    start, end = span or (settings.layers if isinstance(settings.layers, tuple) else (0, None))
    shard_settings = ShardSettings(dtype=settings.dtype, wire_dtype=settings.wire_dtype,
                                   max_sessions=settings.max_sessions, cache_ttl=settings.cache_ttl,
                                   max_cache_bytes=settings.max_cache_bytes, memory=settings.memory,
                                   threads=threads or settings.threads,
                                   compute=settings.compute, quant=settings.quant, compile=settings.compile,
                                   matmul=settings.matmul, ctx_size=settings.ctx_size, kv_dtype=settings.kv_dtype)
    return ModelShard(settings.model, start, end, shard_settings, cache_dir=settings.cache_dir)


def check_role(role: str, backend: ShardBackend) -> str | None:
    last = backend.total_layers - 1
    if role == "tail" and not backend.is_tail:
        return f"a tail must run through the last layer ({last}); use --layers A-{last}"
    if role == "middle" and backend.is_tail:
        return f"a middle node must stop before the last layer ({last}); this is a tail"
    if role == "head" and backend.is_tail:
        return "this head runs every layer; use --role full"
    return None
