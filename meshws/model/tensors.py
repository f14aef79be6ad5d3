"""Hidden states <-> raw little-endian bytes, and the small tensor helpers a shard shares.

Nothing is pickled: a tensor crosses the wire as its bytes, a shape and a dtype name.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .backend import DTYPE_SIZES, TensorPayload

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert set(TORCH_DTYPES) == set(DTYPE_SIZES)  # one list of dtype names for the wire and the shard


def tensor_from_bytes(body: bytes | memoryview, shape: Sequence[int], dtype: str, hidden_size: int,
                      compute_dtype: torch.dtype) -> torch.Tensor:
    """Hidden states `[1, tokens, hidden_size]` from bytes; ValueError names what does not fit."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    shape = [int(n) for n in shape]
    if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != hidden_size:
        raise ValueError(f"hidden states must have shape [1, tokens, {hidden_size}], got {shape}")
    expected = shape[0] * shape[1] * shape[2] * DTYPE_SIZES[dtype]
    if len(body) != expected:
        raise ValueError(f"body has {len(body)} bytes, shape {shape} x {dtype} needs {expected}")
    # One copy into memory we own (torch will not wrap read-only bytes), then the cast.
    tensor = torch.frombuffer(bytearray(body), dtype=TORCH_DTYPES[dtype]).view(shape)
    return tensor.to(compute_dtype)


def payload_from_tensor(hidden: torch.Tensor, past_len: int, wire_dtype: str) -> TensorPayload:
    wire = hidden.to(TORCH_DTYPES[wire_dtype]).contiguous()
    body = wire.view(torch.uint8).numpy().tobytes()
    return TensorPayload(body=body, shape=list(wire.shape), past_len=past_len, dtype=wire_dtype)


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a cache's keys and values (a transformers cache, or one that says: `lean.LeanCache`)."""
    if isinstance(getattr(cache, "nbytes", None), int):
        return cache.nbytes
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


def cache_length(cache: Any) -> int:
    """Positions a cache holds, read from its tensors (a lean cache says)."""
    if isinstance(getattr(cache, "length", None), int):
        return cache.length
    return int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0


def crop_cache(cache: Any, length: int) -> None:
    """Cut every layer of a transformers cache back to `length` positions (undo a failed step).

    Only plain layers can be cut back; a sliding window that dropped its oldest position
    cannot, and raises ValueError (the caller drops the session's cache instead).
    """
    if hasattr(cache, "crop_to"):  # a lean cache: positions beyond `length` are simply overwritten later
        cache.crop_to(length)
        return
    layers = list(getattr(cache, "layers", ()))
    for layer in layers:  # a sliding window's buffer may be shorter than `length` and still hold later positions
        if type(layer).__name__ != "DynamicLayer" and isinstance(getattr(layer, "keys", None), torch.Tensor):
            raise ValueError(f"a {type(layer).__name__} cannot be cut back")
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() < 2 or keys.shape[-2] <= length:
            continue
        layer.crop(length - keys.shape[-2])  # a negative count: positions to drop


def positions(past_len: int, count: int) -> torch.Tensor:
    """Position ids `[1, count]` starting at `past_len`."""
    return torch.arange(past_len, past_len + count, dtype=torch.long).unsqueeze(0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def causal_mask(past: int, count: int, window: int | None) -> torch.Tensor | None:
    """Which keys each of `count` query positions (from `past`) may see: None when plain causal from 0 will do."""
    if count == 1:
        return None  # one query: the keys handed to attention are exactly what it may see
    if past == 0 and window is None:
        return None
    query = torch.arange(past, past + count).unsqueeze(1)
    key = torch.arange(past + count).unsqueeze(0)
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    return allowed
