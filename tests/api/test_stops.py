"""TextAssembler: pieces of text from token ids, held back at half characters and at the start of
a stop sequence, cut at the first stop sequence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from swarm.api.stops import TextAssembler


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_no_stops_streams_everything() -> None:
    t = TextAssembler(chars)
    assert [t.feed([ord(c)]) for c in "abc"] == ["a", "b", "c"]
    assert t.finish() == "" and t.completion_tokens == 3 and not t.stopped


def test_half_a_utf8_character_is_held_back() -> None:
    t = TextAssembler(utf8)
    e = "é".encode()
    assert t.feed([ord("a"), e[0]]) == "a"
    assert t.feed([e[1]]) == "é"


def test_a_possible_stop_start_is_held_back_then_released() -> None:
    t = TextAssembler(chars, stops=["END"])
    assert t.feed([ord("x"), ord("E")]) == "x"
    assert t.feed([ord("N")]) == ""
    assert t.feed([ord("o")]) == "ENo"
    assert t.finish() == ""


def test_stop_cuts_and_ends() -> None:
    t = TextAssembler(chars, stops=["zz", "END"])
    assert t.feed([ord(c) for c in "hello E"]) == "hello "
    assert t.feed([ord(c) for c in "ND and more"]) == ""
    assert t.stopped and t.stop_sequence == "END" and t.shown == "hello "
    assert t.completion_tokens == len("hello END and more")
    assert t.feed([ord("q")]) == "" and t.completion_tokens == len("hello END and more")


def test_earliest_stop_wins() -> None:
    t = TextAssembler(chars, stops=["cd", "b"])
    t.feed([ord(c) for c in "abcd"])
    assert t.shown == "a" and t.stop_sequence == "b"


@given(
    text=st.text(alphabet="abcE\n", max_size=40),
    stops=st.lists(st.text(alphabet="abcE\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(1, 5), max_size=40),
)
def test_pieces_are_the_text_up_to_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    t = TextAssembler(chars, stops)
    ids, pos, out = [ord(c) for c in text], 0, []
    for n in [*cuts, len(ids)]:
        out.append(t.feed(ids[pos : pos + n]))
        pos += n
    out.append(t.finish())
    want, stopped = text, False
    for end in range(1, len(text) + 1):  # the first stop to be complete, token by token
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            want, stopped = text[: end - max(len(s) for s in done)], True
            break
    assert "".join(out) == want
    assert t.stopped == stopped
