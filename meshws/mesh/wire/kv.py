"""Standby frames (`kv`): a session's keys and values on their way to its standby, and the standby's answer.

A 4-byte big-endian header length, a JSON header `{type: "kv", sid, start, shape: [layers, 2, kv_heads, positions,
width], dtype, enc}`, then the rows as the serving node's cache stores them (`model.kv_copies`: each layer's keys,
then its values), zstd-compressed when `enc` says so and it pays. `dtype` is the cache's kind: float32, bfloat16,
or q8_0 (its blocks' bytes, `width` in bytes). The standby answers each frame with a control frame `kv_ack {sid,
length}`: the positions its copy of the session holds.

As with tensor frames, the header is checked and the body's size derived from the shape before it is inflated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from .fields import FrameError, int_field, is_int, sid_field
from .tensors import _decompress, _packed, body_bytes, read_header

KV_SIZES = {"float32": 4, "bfloat16": 2, "q8_0": 1}  # bytes of one stored value (q8_0: its blocks' bytes)
MAX_KV_POSITIONS = 1024  # positions one frame may carry
_HEADER_LENGTH = struct.Struct(">I")
KIND = b'{"type":"kv"'  # how a standby frame's header begins (`is_kv_frame`)


@dataclass(frozen=True)
class KVFrame:
    sid: str
    start: int  # the first position the rows hold
    dtype: str
    shape: tuple[int, int, int, int, int]
    body: bytes  # inflated
    wire_bytes: int = 0


def encode_kv(sid: str, start: int, dtype: str, shape: tuple[int, ...], body: bytes, compress_min_bytes: int) -> bytes:
    header: dict[str, Any] = {"type": "kv", "sid": sid, "start": start, "shape": list(shape), "dtype": dtype}
    return _packed(header, body, compress_min_bytes)


def is_kv_frame(data: bytes) -> bool:
    """A standby frame, not a tensor frame (meshws writes the type first)."""
    return data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + len(KIND)] == KIND


def decode_kv(data: bytes, max_frame_bytes: int) -> KVFrame:
    """The frame checked and inflated; FrameError (with the sid when known) names what is wrong."""
    header, offset = read_header(data, max_frame_bytes, "kv")
    sid = sid_field(header)
    try:
        start = int_field(header, "start", 0)
        dtype, shape, enc = header.get("dtype"), header.get("shape"), header.get("enc")
        if dtype not in KV_SIZES:
            raise FrameError(f"dtype must be one of {sorted(KV_SIZES)}, got {dtype!r}")
        if not isinstance(shape, list) or len(shape) != 5 or not all(is_int(n) and n > 0 for n in shape) \
                or shape[1] != 2 or shape[3] > MAX_KV_POSITIONS:
            raise FrameError(f"shape must be [layers, 2, kv_heads, positions <= {MAX_KV_POSITIONS}, width], "
                             f"got {shape!r}")
        if enc not in (None, "zstd"):
            raise FrameError(f"unknown encoding {enc!r}")
        expected = body_bytes(shape, dtype, KV_SIZES[dtype], max_frame_bytes)
        body = data[offset:]
        if enc == "zstd":
            body = _decompress(body, expected)
        if len(body) != expected:
            raise FrameError(f"body has {len(body)} bytes but shape {shape} x {dtype} needs {expected}")
    except FrameError as exc:
        raise FrameError(str(exc), sid) from None
    return KVFrame(sid, start, dtype, tuple(shape), bytes(body), len(data))  # type: ignore[arg-type]


@dataclass(frozen=True)
class KVAck:
    """A standby's answer to a `kv` frame: the positions its copy of the session holds now."""

    type: ClassVar[str] = "kv_ack"
    sid: str
    length: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "sid": self.sid, "length": self.length}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "KVAck":
        return cls(sid_field(data), int_field(data, "length", 0))
