"""Tensor frames (`fwd`): hidden states between shards, as raw bytes behind a JSON header.

A 4-byte big-endian header length, a JSON header `{type: "fwd", sid, step, mode,
past_len, shape, dtype, enc, ids?, drafts?, group?}`, then the raw little-endian tensor bytes, zstd
compressed when `enc` says so. `drafts`: the step's last positions carry guessed
tokens (speculative decoding); the tail answers with every one it agrees with.

A wave's decode steps bound for one hop travel as one frame (`encode_rows`): `{type: "fwd",
mode: "decode", rows: [{sid, step, past_len, group?}, ...], shape: [rows, 1, hidden], dtype,
enc}`, the rows' hidden states one after another in one body. Each row is its session's
step, as if it had come alone: a row whose fields are wrong is refused alone (`problem`).

The header is checked and the body's size derived from the shape before anything is
inflated: `read_forward_headers` reads only the header (a receiver checks each step against
its session and its model first), `inflate_forward` / `inflate_rows` then inflate and check
the body (off the event loop when it is large).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import orjson
import zstandard

from ...model.backend import DTYPE_SIZES
from .fields import FrameError, int_field, is_int, sid_field

MODES = ("prefill", "decode")
MAX_DRAFTS = 16  # guessed tokens one step may carry
MAX_GROUP = 1024  # the largest wave a decode frame may announce (`group`)
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_COMPRESS_MIN_BYTES = 64 * 1024

_HEADER_LENGTH = struct.Struct(">I")


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
    wire_bytes: int = field(default=0, compare=False)  # size of the frame as it travelled
    drafts: tuple[int, ...] = ()  # guessed tokens the step's last positions carry, for the tail to verify
    group: int = 1  # decode steps the sender computed in this step's batch (their frames follow back to back)


def encode_forward(sid: str, step: int, mode: str, past_len: int, shape: list[int] | tuple[int, ...], dtype: str,
                   body: bytes, ids: list[int] | None = None,
                   compress_min_bytes: int = DEFAULT_COMPRESS_MIN_BYTES, drafts: tuple[int, ...] | list[int] = (),
                   group: int = 1) -> bytes:
    header: dict[str, Any] = {"type": "fwd", "sid": sid, "step": step, "mode": mode, "past_len": past_len,
                              "shape": list(shape), "dtype": dtype}
    if ids is not None:
        header["ids"] = ids
    if drafts:
        header["drafts"] = list(drafts)
    if group > 1:
        header["group"] = group
    return _packed(header, body, compress_min_bytes)


@dataclass(frozen=True)
class DecodeRow:
    """One session's decode step of one position, as a wave's frame carries it."""

    sid: str
    step: int
    past_len: int
    body: bytes  # one position's hidden state
    group: int = 1


def encode_rows(rows: Sequence[DecodeRow], hidden: int, dtype: str,
                compress_min_bytes: int = DEFAULT_COMPRESS_MIN_BYTES) -> bytes:
    """Decode steps of several sessions, bound for one hop, as one frame (one header, one body)."""
    listed = [{"sid": row.sid, "step": row.step, "past_len": row.past_len, **({"group": row.group}
                                                                              if row.group > 1 else {})}
              for row in rows]
    header = {"type": "fwd", "mode": "decode", "rows": listed, "shape": [len(rows), 1, hidden], "dtype": dtype}
    return _packed(header, b"".join(row.body for row in rows), compress_min_bytes)


def _packed(header: dict[str, Any], body: bytes, compress_min_bytes: int) -> bytes:
    header["enc"] = None
    if len(body) >= compress_min_bytes:
        packed = zstandard.ZstdCompressor(level=1).compress(body)
        if len(packed) < 0.9 * len(body):  # activations barely compress; send raw unless it pays
            body, header["enc"] = packed, "zstd"
    head = orjson.dumps(header)
    return b"".join((_HEADER_LENGTH.pack(len(head)), head, body))


@dataclass(frozen=True)
class ForwardHeader:
    """A tensor frame's checked header, before its body is inflated."""

    sid: str
    step: int
    mode: str
    past_len: int
    shape: tuple[int, ...]
    dtype: str
    enc: str | None
    ids: tuple[int, ...] | None
    body_offset: int  # where the body starts in the frame
    body_bytes: int  # the body's size once inflated (from shape x dtype)
    wire_bytes: int
    drafts: tuple[int, ...] = ()
    group: int = 1
    row: int = 0  # in a wave's frame: which of its `rows` (its part of the body)
    rows: int = 1
    problem: str | None = None  # a wave's row whose own fields are wrong: refused alone

    @property
    def positions(self) -> int:
        """Token positions the frame carries (its second-to-last dimension)."""
        return self.shape[-2] if len(self.shape) >= 2 else 1


def decode_forward(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ForwardFrame:
    return inflate_forward(read_forward_header(data, max_frame_bytes), data)


def decode_rows(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[ForwardFrame]:
    """Any tensor frame as the steps it carries (one, or a wave's rows), inflated: rows with a `problem` left out."""
    headers = [header for header in read_forward_headers(data, max_frame_bytes) if header.problem is None]
    return inflate_rows(headers, data) if headers and headers[0].rows > 1 else \
        [inflate_forward(header, data) for header in headers]


def inflate_forward(header: ForwardHeader, data: bytes) -> ForwardFrame:
    """The frame with its body inflated and checked against the header's shape x dtype."""
    body = data[header.body_offset :]
    try:
        if header.enc == "zstd":
            body = _decompress(body, header.body_bytes)
        if len(body) != header.body_bytes:
            raise FrameError(f"body has {len(body)} bytes but shape {list(header.shape)} x {header.dtype} needs "
                             f"{header.body_bytes}")
    except FrameError as exc:
        raise FrameError(str(exc), header.sid) from None
    return ForwardFrame(header.sid, header.step, header.mode, header.past_len, header.shape, header.dtype,
                        bytes(body), header.ids, header.wire_bytes, header.drafts, header.group)


def inflate_rows(headers: Sequence[ForwardHeader], data: bytes) -> list[ForwardFrame]:
    """A wave's frame: its body inflated once and checked against the whole shape, then each row's step."""
    first = headers[0]
    expected = first.body_bytes * first.rows
    body = data[first.body_offset :]
    if first.enc == "zstd":
        body = _decompress(body, expected)
    if len(body) != expected:
        raise FrameError(f"body has {len(body)} bytes but {first.rows} rows of {first.body_bytes} need {expected}")
    return [ForwardFrame(h.sid, h.step, h.mode, h.past_len, h.shape, h.dtype,
                         bytes(body[h.row * h.body_bytes : (h.row + 1) * h.body_bytes]), None, h.wire_bytes // h.rows,
                         (), h.group) for h in headers]


def read_forward_header(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ForwardHeader:
    """A one-step frame's header, checked; the body is not looked at yet."""
    headers = read_forward_headers(data, max_frame_bytes)
    if headers[0].rows > 1:
        raise FrameError("a wave's frame where one step was expected")
    return headers[0]


def read_forward_headers(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[ForwardHeader]:
    """The frame's steps (one, or a wave's rows), their headers checked; the body is not looked at yet."""
    header, offset = read_header(data, max_frame_bytes, "fwd")
    if "rows" in header:
        return _rows_checked(header, offset, len(data), max_frame_bytes)
    sid = sid_field(header)
    try:
        return [_checked(header, offset, sid, len(data), max_frame_bytes)]
    except FrameError as exc:
        raise FrameError(str(exc), sid) from None


def read_header(data: bytes, max_frame_bytes: int, kind: str) -> tuple[dict[str, Any], int]:
    """A binary frame's JSON header, which must be an object of type `kind`, and where its body starts."""
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
    if header.get("type") != kind:
        raise FrameError(f"binary frame of unknown type {header.get('type')!r}")
    return header, _HEADER_LENGTH.size + header_len


def _rows_checked(header: dict[str, Any], offset: int, size: int, max_frame_bytes: int) -> list[ForwardHeader]:
    """A wave's frame: the frame's own fields must be right; a row's wrong field is that row's `problem`."""
    rows = header.get("rows")
    if not isinstance(rows, list) or not 2 <= len(rows) <= MAX_GROUP or not all(isinstance(r, dict) for r in rows):
        raise FrameError(f"rows must be a list of 2 to {MAX_GROUP} objects (one step travels alone)")
    shape = header.get("shape")
    if header.get("mode") != "decode" or not isinstance(shape, list) or len(shape) != 3 \
            or shape[:2] != [len(rows), 1] or not is_int(shape[2]) or shape[2] <= 0:
        raise FrameError(f"a wave's frame carries decode steps of shape [rows, 1, hidden], got {shape!r}")
    if "ids" in header or "drafts" in header:
        raise FrameError("a wave's frame carries no ids or drafts (such steps travel alone)")
    common = {"mode": "decode", "shape": [1, 1, shape[2]], "dtype": header.get("dtype"), "enc": header.get("enc")}
    one = _checked({**common, "step": 0, "past_len": 0}, offset, "", size, max_frame_bytes)
    if one.body_bytes * len(rows) > max_frame_bytes:
        raise FrameError(f"{len(rows)} rows of {one.body_bytes} bytes are above the limit of {max_frame_bytes}")
    found = []
    for index, row in enumerate(rows):
        sid = sid_field(row)  # (a row without a session to answer cannot stand alone: the frame is refused)
        fields = {name: row[name] for name in ("step", "past_len", "group") if name in row}
        try:
            checked = _checked({**common, **fields}, offset, sid, size, max_frame_bytes)
        except FrameError as exc:  # (refused with its own step where it has one, so its sender matches the error)
            step = row.get("step")
            checked = replace(one, sid=sid, step=step if is_int(step) and step >= 0 else 0, problem=str(exc))
        found.append(replace(checked, row=index, rows=len(rows)))
    if len({header.sid for header in found}) < len(found):  # (one session, one step at a time)
        raise FrameError("a wave's frame lists a session twice")
    return found


def _checked(header: dict[str, Any], offset: int, sid: str, size: int, max_frame_bytes: int) -> ForwardHeader:
    step = int_field(header, "step", 0)
    mode = header.get("mode")
    if mode not in MODES:
        raise FrameError(f"mode must be one of {MODES}, got {mode!r}")
    past_len = int_field(header, "past_len", 0)
    dtype = header.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise FrameError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    shape = header.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 4 or not all(is_int(n) and n > 0 for n in shape):
        raise FrameError(f"shape must be a list of 1 to 4 positive integers, got {shape!r}")
    ids = header.get("ids")
    if ids is not None and (not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids)):
        raise FrameError("ids must be a list of non-negative integers")
    drafts = header.get("drafts", [])
    if not isinstance(drafts, list) or len(drafts) > MAX_DRAFTS or not all(is_int(t) and t >= 0 for t in drafts):
        raise FrameError(f"drafts must be a list of at most {MAX_DRAFTS} non-negative integers")
    if drafts and (mode != "decode" or len(shape) < 2 or len(drafts) >= shape[-2]):
        raise FrameError("drafts ride on a decode step with more positions than drafts")
    group = header.get("group", 1)
    if not is_int(group) or not 1 <= group <= MAX_GROUP:
        raise FrameError(f"group must be an integer from 1 to {MAX_GROUP}, got {group!r}")
    expected = body_bytes(shape, dtype, DTYPE_SIZES[dtype], max_frame_bytes)
    enc = header.get("enc")
    if enc not in (None, "zstd"):
        raise FrameError(f"unknown encoding {enc!r}")
    return ForwardHeader(sid, step, mode, past_len, tuple(shape), dtype, enc, tuple(ids) if ids is not None else None,
                         offset, expected, size, tuple(drafts), group)


def body_bytes(shape: list[int], dtype: str, size: int, max_frame_bytes: int) -> int:
    """The bytes a body of `shape` x `dtype` (`size` bytes a value) holds, within the frame limit."""
    expected = size
    for dim in shape:
        expected *= dim
    if expected > max_frame_bytes:
        raise FrameError(f"shape {shape} x {dtype} is {expected} bytes, above the limit of {max_frame_bytes}")
    return expected


def _decompress(body: bytes, expected: int) -> bytes:
    """Inflate only a body whose zstd header declares exactly the expected size (no bombs)."""
    try:
        declared = zstandard.frame_content_size(body)
        if declared != expected:
            raise FrameError(f"zstd body declares {declared} bytes, the shape needs {expected}")
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise FrameError(f"zstd body does not decompress: {exc}") from None
