"""Fuzzing the frame parsers: any input is either refused with a named FrameError or parses consistently."""

import math

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from meshws.mesh.wire import FrameError, decode_control, decode_forward, encode_control, encode_forward
from meshws.model.backend import DTYPE_SIZES


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_binary_frames_raise_only_frame_errors(data):
    """Whatever the bytes: a FrameError, or a frame whose body is exactly its shape x dtype."""
    try:
        frame = decode_forward(data, max_frame_bytes=10_000)
    except FrameError as exc:
        assert str(exc)
        return
    assert len(frame.body) == DTYPE_SIZES[frame.dtype] * math.prod(frame.shape)


def _valid_frame():
    return encode_forward("sid-1", 3, "decode", 7, [1, 1, 8], "bfloat16", bytes(16))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 200))
def test_mutated_tensor_frames_raise_only_frame_errors(flips, cut):
    data = bytearray(_valid_frame())
    for position, value in flips:
        data[position % len(data)] = value
    try:
        frame = decode_forward(bytes(data[: len(data) - cut % 8]))
    except FrameError:
        return
    assert len(frame.body) == 16  # whatever parses is consistent with its own shape and dtype


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
control_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["hello", "open", "token", "cache_miss", "error", "close", "fwd", "nope"])},
    optional={"sid": st.one_of(st.just("s1"), json_values), "lost": json_values, "url": json_values,
              "total_layers": json_values, "chain": json_values, "role": json_values, "node": json_values,
              "reason": json_values, "text": json_values, "step": json_values, "token_id": json_values,
              "version": json_values,
              "model": json_values, "layers": json_values, "route": json_values, "sampling": json_values,
              "message": json_values, "prompt_tokens": json_values},
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(control_frames.map(lambda m: orjson.dumps(m).decode()), st.text(max_size=80)))
def test_random_control_frames_raise_only_frame_errors(text):
    """Whatever the text: a FrameError naming the problem, or a typed message that round-trips."""
    try:
        message = decode_control(text)
    except FrameError as exc:
        assert str(exc)
        return
    assert decode_control(encode_control(message)) == message


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 200))
def test_mutated_wave_frames_raise_only_frame_errors(flips, cut):
    from meshws.mesh.wire import DecodeRow, decode_rows, encode_rows

    data = bytearray(encode_rows([DecodeRow(f"sid-{i}", i, 7, bytes(16)) for i in range(3)], 8, "bfloat16"))
    for position, value in flips:
        data[position % len(data)] = value
    try:
        frames = decode_rows(bytes(data[: len(data) - cut % 8]))
    except FrameError as exc:
        assert str(exc)
        return
    assert all(len(frame.body) == DTYPE_SIZES[frame.dtype] * math.prod(frame.shape) for frame in frames)
