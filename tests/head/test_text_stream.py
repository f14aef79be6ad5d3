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
