"""The frame schema: round trips, compression, and a named error for every bad frame."""

import os
import struct

import orjson
import pytest

from meshws.mesh import wire
from meshws.mesh.wire import FrameError, decode_control, decode_forward, encode_forward
from meshws.model.text.sampling_params import SamplingParams


def _frame(header: dict, body: bytes) -> bytes:
    head = orjson.dumps(header)
    return struct.pack(">I", len(head)) + head + body


GOOD = {"type": "fwd", "sid": "s1", "step": 0, "mode": "decode", "past_len": 7, "shape": [1, 1, 4], "dtype": "bfloat16",
        "enc": None}


def test_decode_frame_round_trip_and_size():
    body = bytes(range(8))
    data = encode_forward("s1", 3, "decode", 7, [1, 1, 4], "bfloat16", body)
    frame = decode_forward(data)
    assert (frame.sid, frame.step, frame.mode, frame.past_len, frame.shape, frame.dtype) == (
        "s1", 3, "decode", 7, (1, 1, 4), "bfloat16")
    assert frame.body == body
    assert frame.wire_bytes == len(data)
    assert frame.group == 1 and b"group" not in data  # a lone step announces no wave
    assert decode_forward(encode_forward("s1", 3, "decode", 7, [1, 1, 4], "bfloat16", body, group=8)).group == 8


def test_decode_step_of_hidden_576_stays_under_1400_bytes():
    sid = "0123456789abcdef0123456789abcdef"
    data = encode_forward(sid, 99999, "decode", 123456, [1, 1, 576], "bfloat16", b"\x01" * 1152)
    assert len(data) <= 1400
    assert len(data) - 1152 - 4 < 256  # header well under 256 bytes


def test_large_compressible_prefill_travels_zstd_and_round_trips():
    body = b"\x00" * (1 * 2048 * 32 * 2)
    data = encode_forward("s", 0, "prefill", 0, [1, 2048, 32], "bfloat16", body, ids=[1, 2, 3])
    assert len(data) < len(body) // 10
    header = orjson.loads(data[4 : 4 + struct.unpack(">I", data[:4])[0]])
    assert header["enc"] == "zstd"
    frame = decode_forward(data)
    assert frame.body == body and frame.ids == (1, 2, 3)


def test_incompressible_body_is_sent_raw():
    body = os.urandom(200_000)
    data = encode_forward("s", 0, "prefill", 0, [1, 100_000], "bfloat16", body)
    assert orjson.loads(data[4 : 4 + struct.unpack(">I", data[:4])[0]])["enc"] is None


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"\x00\x00", "shorter"),
        (struct.pack(">I", 999) + b"{}", "does not fit"),
        (struct.pack(">I", 3) + b"abc", "not JSON"),
        (_frame([1, 2], b""), "JSON object"),
        (_frame({**GOOD, "type": "nope"}, b"\x00" * 8), "unknown type"),
        (_frame({**GOOD, "sid": ""}, b"\x00" * 8), "sid"),
        (_frame({**GOOD, "mode": "sideways"}, b"\x00" * 8), "mode"),
        (_frame({**GOOD, "past_len": -1}, b"\x00" * 8), "past_len"),
        (_frame({**GOOD, "dtype": "int8"}, b"\x00" * 8), "dtype"),
        (_frame({**GOOD, "dtype": {}}, b"\x00" * 8), "dtype"),  # unhashable: once raised TypeError on a read loop
        (_frame({**GOOD, "mode": []}, b"\x00" * 8), "mode"),
        (_frame({**GOOD, "enc": {}}, b"\x00" * 8), "encoding"),
        (_frame({**GOOD, "shape": [1, -1, 4]}, b"\x00" * 8), "shape"),
        (_frame({**GOOD, "shape": "1,1,4"}, b"\x00" * 8), "shape"),
        (_frame(GOOD, b"\x00" * 7), "needs 8"),
        (_frame({**GOOD, "enc": "gzip"}, b"\x00" * 8), "encoding"),
        (_frame({**GOOD, "enc": "zstd"}, b"garbage!"), "zstd"),
        (_frame({**GOOD, "shape": [1, 1 << 30, 1 << 20]}, b""), "above the limit"),
        (_frame({**GOOD, "ids": [1, "x"]}, b"\x00" * 8), "ids"),
        (_frame({**GOOD, "group": 0}, b"\x00" * 8), "group"),
        (_frame({**GOOD, "group": 10**6}, b"\x00" * 8), "group"),
        (_frame({**GOOD, "group": "8"}, b"\x00" * 8), "group"),
    ],
)
def test_bad_tensor_frames_raise_named_errors(data, needle):
    with pytest.raises(FrameError, match=needle):
        decode_forward(data)


def test_zstd_bomb_is_bounded_by_the_declared_shape():
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\x00" * 10_000_000)
    with pytest.raises(FrameError, match="zstd"):
        decode_forward(_frame({**GOOD, "enc": "zstd"}, bomb))


def test_frame_above_the_size_limit_is_refused():
    data = encode_forward("s", 0, "prefill", 0, [1, 100, 576], "bfloat16", os.urandom(115200))
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_forward(data, max_frame_bytes=1000)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"type": "launch", "sid": "a"}', "unknown frame type"),
        ('{"type": "close"}', "sid"),
        ('{"type": "close", "sid": 5}', "sid"),
        ('{"type": "token", "sid": "a", "token_id": -3}', "token_id"),
        ('{"type": "token", "sid": "a"}', "token_id or a text"),
        ('{"type": "hello", "version": "2", "model": "m"}', "version"),
        ('{"type": "hello", "version": 1, "model": "m"}', "protocol 1"),
        ('{"type": "hello", "version": 5, "layers": [0, 1], "total_layers": 30}', "model"),
        ('{"type": "hello", "version": 5, "model": "m", "layers": [5, 2]}', "layers"),
        ('{"type": "hello", "version": 5, "model": "m", "layers": [0, 40], "total_layers": 30}', "beyond"),
        ('{"type": "hello", "version": 5, "model": "m", "layers": [0, 3], "total_layers": 30, "role": "head",'
         ' "node": "n", "chain": [{}]}', "node"),
        ('{"type": "error"}', "message"),
        ('{"type": "error", "message": "x", "lost": "yes"}', "lost"),
        ('{"type": "open", "sid": "a", "route": [{"url": "http://x"}]}', "ws://"),
        ('{"type": "open", "sid": "a", "prompt_tokens": -1}', "prompt_tokens"),
        ('{"type": "cache_miss", "sid": "a"}', "step"),
        ('{"type": "open", "sid": "a", "route": {}}', "route"),
        ('{"type": "open", "sid": "a", "sampling": 3}', "sampling"),
        ('{"type": "open", "sid": "a", "resume": "yes"}', "resume"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": {}}', "hops"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [3]}', "hop report"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": -1, "cache_len": 4}]}', "ms"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": 1e300, "cache_len": 4}]}', "ms"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": true, "cache_len": 4}]}', "ms"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": 1, "cache_len": 4.5}]}',
         "cache_len"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "", "ms": 1, "cache_len": 4}]}', "node"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": 1, "cache_len": 4, "busy": 1.5}]}',
         "busy"),
        ('{"type": "token", "sid": "a", "token_id": 3, "hops": [{"node": "t", "ms": 1, "cache_len": 4, "busy": true}]}',
         "busy"),
        ('{"type": "token", "sid": "a", "token_id": 3, "logprobs": [[-0.5, []], [-1, []]]}', "logprobs"),  # 1 token
        ('{"type": "token", "sid": "a", "token_id": 3, "logprobs": [[0.5, []]]}', "logprobs"),  # above 0
        ('{"type": "token", "sid": "a", "token_id": 3, "logprobs": [[-0.5, [[-1, -0.5]]]]}', "logprobs"),
        ('{"type": "token", "sid": "a", "token_id": 3, "logprobs": [[-0.5, [[1, -0.5]] ]] }'.replace(
            "[[1, -0.5]]", "[" + ", ".join(["[1, -0.5]"] * 21) + "]"), "logprobs"),  # 21 alternatives
    ],
)
def test_bad_control_frames_raise_named_errors(text, needle):
    with pytest.raises(FrameError, match=needle):
        decode_control(text)


def test_every_message_round_trips():
    messages = [
        wire.Hello("m", (0, 15), "head", "node-1", 30, (wire.ChainHop("node-1", (0, 15)),
                                                        wire.ChainHop("tail@x", (15, 30)))),
        wire.Open("a", SamplingParams(temperature=0.7, seed=3), 12, (wire.RouteHop("ws://h:1", (15, 30)),)),
        wire.Open("b"),
        wire.Open("c", SamplingParams(temperature=0), 40, resume=True),
        wire.Token("a", 2, 17),
        wire.Token("a", 3, None, ""),
        wire.Token("a", 4, 9, None, (5, 9),
                   (wire.HopReport("middle@h:1", 3.25, 40, 9.5, 2, busy=0.75), wire.HopReport("t", 0.0, 0))),
        wire.Token("a", 5, 9, None, (5, 9), (), ((-0.25, ((5, -0.25), (7, -2.5))), (-1e4, ()))),
        wire.CacheMiss("a", 4, "evicted"),
        wire.Error("boom", "a", 5, lost=True, url="ws://h:1"),
        wire.Error("bad frame"),
        wire.Close("a"),
    ]
    for message in messages:
        assert decode_control(wire.encode_control(message)) == message


def test_a_bad_field_of_a_known_session_names_the_session():
    with pytest.raises(FrameError) as caught:
        decode_control('{"type": "open", "sid": "s9", "sampling": {"top_p": 7}}')
    assert caught.value.sid == "s9" and "top_p" in str(caught.value)
    with pytest.raises(FrameError) as caught:
        decode_forward(_frame({**GOOD, "sid": "s8", "mode": "sideways"}, b"\x00" * 8))
    assert caught.value.sid == "s8"


def test_a_waves_rows_travel_as_one_frame_and_read_back_as_their_own_steps():
    rows = [wire.DecodeRow(f"s{i}", 10 + i, 20 + i, bytes([i]) * 8, group=3) for i in range(3)]
    data = wire.encode_rows(rows, 4, "bfloat16")
    header = orjson.loads(data[4 : 4 + struct.unpack(">I", data[:4])[0]])
    assert header["shape"] == [3, 1, 4] and len(header["rows"]) == 3 and "sid" not in header
    frames = wire.decode_rows(data)
    assert [(f.sid, f.step, f.past_len, f.shape, f.body, f.group) for f in frames] == [
        (f"s{i}", 10 + i, 20 + i, (1, 1, 4), bytes([i]) * 8, 3) for i in range(3)]
    assert wire.decode_rows(encode_forward("s", 1, "decode", 2, [1, 1, 4], "bfloat16", bytes(8)))[0].sid == "s"
    with pytest.raises(FrameError, match="wave"):  # where one step was expected
        decode_forward(data)
    quiet = [wire.DecodeRow(f"q{i}", 0, 0, bytes(4096)) for i in range(20)]
    packed = wire.encode_rows(quiet, 2048, "bfloat16", compress_min_bytes=1024)
    assert len(packed) < 20 * 4096 // 10 and [f.body for f in wire.decode_rows(packed)] == [bytes(4096)] * 20


def test_a_wrong_row_is_refused_alone_and_a_wrong_wave_frame_whole():
    def wave(rows, **header):
        fields = {"type": "fwd", "mode": "decode", "rows": rows, "shape": [len(rows), 1, 4], "dtype": "bfloat16",
                  "enc": None, **header}
        return _frame(fields, bytes(8 * len(rows)))

    good, other = {"sid": "a", "step": 1, "past_len": 2}, {"sid": "e", "step": 1, "past_len": 2}
    headers = wire.read_forward_headers(wave([good, {"sid": "b", "step": -1, "past_len": 2},
                                              {"sid": "c", "step": 1, "past_len": 2, "group": 0}, other]))
    assert [(h.sid, h.problem is None) for h in headers] == [("a", True), ("b", False), ("c", False), ("e", True)]
    assert "step" in headers[1].problem and "group" in headers[2].problem
    assert headers[2].step == 1  # (refused with its own step, which its sender waits on)
    assert [f.sid for f in wire.decode_rows(wave([good, {"sid": "b", "step": -1, "past_len": 2}]))] == ["a"]
    for bad, needle in [
        (wave([good, {"step": 1, "past_len": 2}]), "sid"),  # a row no one could be told about
        (wave([good, other], shape=[3, 1, 4]), "shape"),
        (wave([good]), "rows"),  # one step travels as the one-step frame
        (wave([good, other], mode="prefill"), "shape"),
        (wave([good, other], ids=[1]), "ids"),
        (wave([]), "rows"),
        (wave([good, 3]), "rows"),
        (wave([good, other], dtype="int3"), "dtype"),
        (_frame({"type": "fwd", "mode": "decode", "rows": [good, other], "shape": [2, 1, 4], "dtype": "bfloat16",
                 "enc": None}, bytes(12)), "body"),
        (_frame({"type": "fwd", "mode": "decode", "rows": [good, other], "shape": [2, 1, 4], "dtype": "bfloat16",
                 "enc": "zstd"}, __import__("zstandard").ZstdCompressor().compress(bytes(1 << 20))), "declares"),
    ]:
        with pytest.raises(FrameError, match=needle):
            wire.decode_rows(bad)
    with pytest.raises(FrameError, match="limit"):
        wire.read_forward_headers(_frame({"type": "fwd", "mode": "decode",
                                          "rows": [{**good, "sid": f"s{i}"} for i in range(40)],
                                          "shape": [40, 1, 4096], "dtype": "float32", "enc": None}, b""),
                                  max_frame_bytes=500_000)


def test_a_wave_frame_naming_a_session_twice_is_refused_whole():
    rows = [wire.DecodeRow("a", 1, 2, bytes(8)), wire.DecodeRow("a", 2, 3, bytes(8))]
    with pytest.raises(FrameError, match="twice"):
        wire.decode_rows(wire.encode_rows(rows, 4, "bfloat16"))


def test_standby_frames_round_trip_and_refuse_what_does_not_fit():
    rows = bytes(range(256)) * 24  # [2 layers, 2, 3 heads, 4 positions, 64 values] of bfloat16: 6 KiB
    shape = (2, 2, 3, 4, 64)
    for compress in (1 << 20, 16):  # raw, and zstd (which pays on this repeating body)
        frame = wire.decode_kv(wire.encode_kv("s1", 40, "bfloat16", shape, rows, compress), 1 << 20)
        assert (frame.sid, frame.start, frame.dtype, frame.shape, frame.body) == ("s1", 40, "bfloat16", shape, rows)
    assert wire.is_kv_frame(wire.encode_kv("s1", 0, "q8_0", (1, 2, 1, 1, 68), bytes(136), 1 << 20))
    assert not wire.is_kv_frame(wire.encode_forward("s1", 0, "prefill", 0, [1, 1, 4], "float32", bytes(16)))
    bad = [
        (("s1", 0, "int4", shape, rows), "dtype must be one of"),
        (("s1", 0, "bfloat16", (2, 3, 3, 4, 64), rows), "shape must be"),
        (("s1", 0, "bfloat16", (2, 2, 3, 4096, 64), rows), "shape must be"),  # too many positions for one frame
        (("s1", 0, "bfloat16", shape, rows[:-2]), "needs"),
        (("s1", -1, "bfloat16", shape, rows), "start"),
    ]
    for args, problem in bad:
        with pytest.raises(wire.FrameError, match=problem) as caught:
            wire.decode_kv(wire.encode_kv(*args, 1 << 20), 1 << 20)
        assert caught.value.sid == "s1"  # refused to the session that sent it
    with pytest.raises(wire.FrameError, match="above the limit"):
        wire.decode_kv(wire.encode_kv("s1", 0, "float32", (64, 2, 8, 1024, 128), b"", 1 << 20), 1 << 20)
    assert wire.decode_control(wire.encode_control(wire.KVAck(sid="s1", length=300))) == wire.KVAck("s1", 300)
