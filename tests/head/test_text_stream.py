"""Streaming text: incomplete UTF-8 and possible stop strings are held back until decided."""

from meshws.head.text_stream import TextStream

# A byte-level toy tokenizer: each id is one byte; decode is UTF-8 with replacement.
def decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def push_all(stream, data: bytes):
    return [stream.push_token(b) for b in data]


def test_multibyte_characters_wait_for_their_last_byte():
    stream = TextStream(decode)
    deltas = push_all(stream, "a€b".encode())  # € is three bytes
    assert deltas == ["a", "", "", "€", "b"]
    assert stream.text == "a€b"


def test_stop_string_is_never_emitted_and_prefixes_are_held():
    stream = TextStream(decode, stop=["STOP"])
    deltas = push_all(stream, b"go ST")
    assert "".join(deltas) == "go "  # "ST" might start STOP
    deltas = push_all(stream, b"OP and more")
    assert "".join(deltas) == ""
    assert stream.stopped and stream.text == "go "


def test_held_prefix_is_released_when_it_turns_out_not_to_stop():
    stream = TextStream(decode, stop=["STOP"])
    out = "".join(push_all(stream, b"a STAR"))
    assert out == "a STAR"
    assert not stream.stopped


def test_finish_flushes_held_text_and_incomplete_bytes():
    stream = TextStream(decode, stop=["STOP"])
    out = "".join(push_all(stream, b"end ST")) + stream.finish()
    assert out == "end ST"
    stream = TextStream(decode)
    out = "".join(push_all(stream, b"x\xe2\x82")) + stream.finish()
    assert out == "x\ufffd"


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(decode, stop=["\n\n", "END"])
    out = "".join(push_all(stream, b"one END two\n\nthree"))
    assert out == "one " and stream.stopped


def test_legacy_text_goes_through_the_same_stop_logic():
    stream = TextStream(decode, stop=["</s>"])
    assert stream.push_text("hi </") == "hi "
    assert stream.push_text("s> tail") == ""
    assert stream.stopped


def _held_back_by_every_end(pending: str, stops: list[str]) -> int:
    """The rule, tried end by end: the longest end of `pending` that starts a stop string (and is shorter than it)."""
    return max([size for stop in stops for size in range(1, min(len(stop) - 1, len(pending)) + 1)
                if stop.startswith(pending[-size:])], default=0)


def test_text_held_back_for_stop_strings_is_the_longest_end_that_starts_one():
    import random

    chooser = random.Random(7)
    for _ in range(3000):
        stops = ["".join(chooser.choice("ab") for _ in range(chooser.randint(1, 6))) for _ in range(3)]
        stream = TextStream(decode, stop=stops)
        stream._pending = "".join(chooser.choice("abc") for _ in range(chooser.randint(0, 8)))
        assert stream._held_back() == _held_back_by_every_end(stream._pending, stops), (stream._pending, stops)


def test_a_long_partial_match_is_held_back_whole_and_its_stop_string_ends_the_answer():
    stops = ["Z" * 255] * 15 + ["ab" * 127 + "!"]  # (the longest allowed: a check per token of its few ends)
    stream = TextStream(decode, stop=stops)
    for _ in range(127):
        assert push_all(stream, b"ab") == ["", ""]
    assert len(stream._pending) == 254 and stream.push_token(ord("!")) == "" and stream.stopped
    assert stream.text == ""
