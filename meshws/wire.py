"""The wire format between nodes: this file is the schema.

Control frames are websocket text frames holding one JSON object with `type`
and (except `hello`) `sid`:

  hello       {version, model, layers: [start, end], role, node}    both ways, first
  open        {sid, sampling?, route?}                               head -> tail
  token       {sid, step, token_id, text?}                           tail -> head
  cache_miss  {sid, step, reason}                                    any shard -> head
  error       {sid?, step?, message}                                 any node -> previous
  close       {sid}                                                  head -> tail

Tensor frames are binary: a 4-byte big-endian header length, a JSON header
`{type: "fwd", sid, step, mode: "prefill"|"decode", past_len, shape, dtype,
enc: "zstd"|null, ids?}`, then the raw little-endian tensor bytes (zstd
compressed when `enc` says so). Nothing here is pickled. Every check below
raises `FrameError` with a message fit to send back in an `error` frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

PROTOCOL_VERSION = 1
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
CONTROL_TYPES = ("hello", "open", "token", "cache_miss", "error", "close")
MODES = ("prefill", "decode")
MAX_HEADER_BYTES = 64 * 1024
MAX_SID_LENGTH = 128
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_COMPRESS_MIN_BYTES = 64 * 1024

_HEADER_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be accepted; the message says why."""


@dataclass(frozen=True)
class ForwardFrame:
    sid: str
    step: int  # the head's step counter, echoed in the answer
    mode: str  # "prefill": start the cache at 0; "decode": extend it at past_len
    past_len: int
    shape: tuple[int, ...]
    dtype: str
    body: bytes  # raw tensor bytes, already decompressed
    ids: tuple[int, ...] | None = None  # token ids so far, sent on prefill when sampling needs them
    wire_bytes: int = 0  # size of the frame as it travelled


# -- tensor frames ----------------------------------------------------------


def encode_forward(
    sid: str,
    step: int,
    mode: str,
    past_len: int,
    shape: list[int] | tuple[int, ...],
    dtype: str,
    body: bytes,
    ids: list[int] | None = None,
    compress_min_bytes: int = DEFAULT_COMPRESS_MIN_BYTES,
) -> bytes:
    enc = None
    if len(body) >= compress_min_bytes:
        packed = zstandard.ZstdCompressor(level=1).compress(body)
        if len(packed) < 0.9 * len(body):  # activations barely compress; send raw unless it pays
            body, enc = packed, "zstd"
    header: dict[str, Any] = {
        "type": "fwd",
        "sid": sid,
        "step": step,
        "mode": mode,
        "past_len": past_len,
        "shape": list(shape),
        "dtype": dtype,
        "enc": enc,
    }
    if ids is not None:
        header["ids"] = ids
    head = orjson.dumps(header)
    return b"".join((_HEADER_LENGTH.pack(len(head)), head, body))


def decode_forward(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ForwardFrame:
    if len(data) > max_frame_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds the limit of {max_frame_bytes}")
    if len(data) < _HEADER_LENGTH.size:
        raise FrameError("binary frame shorter than its 4-byte header length")
    (header_len,) = _HEADER_LENGTH.unpack_from(data)
    if header_len > MAX_HEADER_BYTES or _HEADER_LENGTH.size + header_len > len(data):
        raise FrameError(f"header length {header_len} does not fit the frame")
    try:
        header = orjson.loads(data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + header_len])
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("frame header must be a JSON object")
    if header.get("type") != "fwd":
        raise FrameError(f"binary frame of unknown type {header.get('type')!r}")
    sid = _sid(header)
    step = _int_field(header, "step", minimum=0)
    mode = header.get("mode")
    if mode not in MODES:
        raise FrameError(f"mode must be one of {MODES}, got {mode!r}")
    past_len = _int_field(header, "past_len", minimum=0)
    dtype = header.get("dtype")
    if dtype not in DTYPE_SIZES:
        raise FrameError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    shape = header.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 4
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise FrameError(f"shape must be a list of 1 to 4 positive integers, got {shape!r}")
    ids = header.get("ids")
    if ids is not None and (
        not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise FrameError("ids must be a list of non-negative integers")
    expected = DTYPE_SIZES[dtype]
    for dim in shape:
        expected *= dim
    if expected > max_frame_bytes:
        raise FrameError(f"shape {shape} x {dtype} is {expected} bytes, above the limit of {max_frame_bytes}")
    body = data[_HEADER_LENGTH.size + header_len :]
    enc = header.get("enc")
    if enc == "zstd":
        body = _decompress(body, expected)
    elif enc is not None:
        raise FrameError(f"unknown encoding {enc!r}")
    if len(body) != expected:
        raise FrameError(f"body has {len(body)} bytes but shape {shape} x {dtype} needs {expected}")
    return ForwardFrame(
        sid, step, mode, past_len, tuple(shape), dtype, bytes(body), tuple(ids) if ids is not None else None, len(data)
    )


def _decompress(body: bytes, expected: int) -> bytes:
    """Inflate only a body whose zstd header declares exactly the expected size (no bombs)."""
    try:
        declared = zstandard.frame_content_size(body)
        if declared != expected:
            raise FrameError(f"zstd body declares {declared} bytes, the shape needs {expected}")
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise FrameError(f"zstd body does not decompress: {exc}") from None


# -- control frames ---------------------------------------------------------


def encode_control(message: dict[str, Any]) -> str:
    return orjson.dumps(message).decode()


def decode_control(text: str | bytes) -> dict[str, Any]:
    """Parse a text frame and check the fields its type needs."""
    if len(text) > MAX_HEADER_BYTES * 4:
        raise FrameError(f"control frame of {len(text)} bytes is too large")
    try:
        message = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"control frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise FrameError("control frame must be a JSON object")
    kind = message.get("type")
    if kind not in CONTROL_TYPES:
        raise FrameError(f"unknown frame type {kind!r}")
    if kind == "hello":
        _int_field(message, "version", minimum=0)
        if not isinstance(message.get("model"), str):
            raise FrameError("hello needs a model id")
        layers = message.get("layers")
        if layers is not None and not _is_layer_range(layers):
            raise FrameError("hello layers must be [start, end] with 0 <= start < end")
        return message
    if kind == "error":
        if not isinstance(message.get("message"), str):
            raise FrameError("error frame needs a message")
        if message.get("sid") is not None:
            _sid(message)
        return message
    _sid(message)
    if kind == "token":
        token_id = message.get("token_id")
        if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0):
            raise FrameError("token_id must be a non-negative integer or null")
        if token_id is None and not isinstance(message.get("text"), str):
            raise FrameError("a token frame needs a token_id or a text")
    if kind == "open":
        route = message.get("route")
        if route is not None and not isinstance(route, list):
            raise FrameError("route must be a list of hops")
        if message.get("sampling") is not None and not isinstance(message["sampling"], dict):
            raise FrameError("sampling must be an object")
    return message


def hello(model: str, layers: tuple[int, int], role: str, node: str) -> dict[str, Any]:
    return {
        "type": "hello",
        "version": PROTOCOL_VERSION,
        "model": model,
        "layers": list(layers),
        "role": role,
        "node": node,
    }


def _is_layer_range(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
        and 0 <= value[0] < value[1]
    )


def _sid(message: dict[str, Any]) -> str:
    sid = message.get("sid")
    if not isinstance(sid, str) or not sid or len(sid) > MAX_SID_LENGTH:
        raise FrameError(f"sid must be a non-empty string of at most {MAX_SID_LENGTH} characters")
    return sid


def _int_field(message: dict[str, Any], name: str, minimum: int) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FrameError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
