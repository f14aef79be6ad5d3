"""The wire format between nodes: this package is the schema, and the only reader of peers' raw JSON.

Control frames (`control`) are websocket text frames holding one JSON object:

  Hello     {type: "hello", version, model, layers: [start, end], role, node,
             total_layers, chain: [{node, layers}]}                 both ways, first
  Open      {type: "open", sid, sampling?, prompt_tokens?, route?: [{url, layers?}], route_mac?, resume?,
             fork?: {sid, length}, layers?}
                                                                     head -> tail
  Token     {type: "token", sid, step, token_id, text?, token_ids?,
             hops?: [{node, ms, cache_len}]}                         tail -> head
  CacheMiss {type: "cache_miss", sid, step, reason}                 any shard -> head
  Error     {type: "error", sid?, step?, message, lost?, url?}      any node -> previous
  Close     {type: "close", sid}                                    head -> tail
  KVAck     {type: "kv_ack", sid, length}                           standby -> serving node

Tensor frames (`tensors`) are binary: a 4-byte big-endian header length, a JSON header
`{type: "fwd", sid, step, mode: "prefill"|"decode", past_len, shape, dtype,
enc: "zstd"|null, ids?}`, then the raw little-endian tensor bytes; a wave's decode steps for one
hop share one such frame (`encode_rows`: `rows: [{sid, step, past_len, group?}]`, shape
[rows, 1, hidden]). A session's keys and values travel to its standby as `kv` frames (`kv`). Nothing is
pickled.
Every check raises `FrameError` with a message fit to send back in an error frame.
"""

from .control import (
    PROTOCOL_VERSION,
    CacheMiss,
    ChainHop,
    Close,
    ControlMessage,
    Error,
    Hello,
    HopReport,
    KVAck,
    Open,
    RouteHop,
    SessionReply,
    Token,
    decode_control,
    encode_control,
)
from .fields import MAX_SID_LENGTH, FrameError
from .kv import KVFrame, decode_kv, encode_kv, is_kv_frame
from .tensors import (
    DEFAULT_COMPRESS_MIN_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    DecodeRow,
    ForwardFrame,
    ForwardHeader,
    decode_forward,
    decode_rows,
    encode_forward,
    encode_rows,
    inflate_forward,
    inflate_rows,
    read_forward_header,
    read_forward_headers,
)

__all__ = [
    "PROTOCOL_VERSION", "CacheMiss", "ChainHop", "Close", "ControlMessage", "Error", "Hello", "HopReport", "Open",
    "RouteHop", "SessionReply", "Token", "decode_control", "encode_control", "MAX_SID_LENGTH", "FrameError",
    "DEFAULT_COMPRESS_MIN_BYTES", "DEFAULT_MAX_FRAME_BYTES", "MAX_HEADER_BYTES", "DecodeRow", "ForwardFrame",
    "ForwardHeader", "decode_forward", "decode_rows", "encode_forward", "encode_rows", "inflate_forward",
    "inflate_rows", "read_forward_header", "read_forward_headers", "KVAck", "KVFrame", "decode_kv", "encode_kv",
    "is_kv_frame",
]
