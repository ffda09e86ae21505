"""Long prompts and receipts in small frames (swarm.proto.parts): split, joined, bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ContextTooLong, ProtocolError, RequestRefused
from swarm.proto import control as ctl
from swarm.proto.frame import decode_frame, encode_frame
from swarm.proto.messages import parse_message
from swarm.proto.parts import Assembler, frames_of

FRAME_CAP = 64 * 1024  # what a client may send per frame (issue 27): every frame here fits it


def _through_wire(msg: ctl.Control, assembler: Assembler | None = None) -> tuple[object, list[int]]:
    joined = assembler or Assembler()
    frames = frames_of(msg)
    sizes, out = [], None
    for i, frame in enumerate(frames):
        data = encode_frame(frame)
        sizes.append(len(data))
        out = joined.feed(parse_message(decode_frame(data)))
        assert (out is None) == (i < len(frames) - 1)  # whole only at its last frame
    return out, sizes


def test_a_long_prompt_travels_as_ids_in_frames_under_64k() -> None:
    ids = [(i * 7919) % 49152 for i in range(30_000)]
    req = ctl.Gen.checked(ids, max_new_tokens=16, temperature=0.5, seed=3)
    got, sizes = _through_wire(req)
    assert got == req
    assert len(sizes) == 4 and max(sizes) < FRAME_CAP


def test_a_long_text_travels_in_parts_whatever_the_string_cap() -> None:
    text = "Ünïcode 🙂 text " * 2000  # 32k characters: over max_string (4096) many times
    req = ctl.Gen.checked(text=text, chat=True)
    got, sizes = _through_wire(req)
    assert isinstance(got, ctl.Gen) and got.text == text and got.chat
    assert len(sizes) > 8 and max(sizes) < FRAME_CAP


def test_a_short_request_is_one_frame_as_before() -> None:
    req = ctl.Gen.checked([1, 2, 3])
    assert len(frames_of(req)) == 1
    assert _through_wire(req)[0] == req


def test_a_receipt_with_long_token_lists_round_trips() -> None:
    receipt = {"prompt_token_ids": list(range(9000)), "output_token_ids": list(range(3000)), "tokens_per_s": 1.5}
    got, sizes = _through_wire(ctl.Done(receipt))
    assert isinstance(got, ctl.Done) and got.receipt == receipt
    assert max(sizes) < FRAME_CAP


def test_the_assembled_total_is_bounded_while_parts_arrive() -> None:
    joined = Assembler(max_ids=10_000)
    frames = frames_of(ctl.Gen.checked(list(range(20_000))))
    with pytest.raises(ProtocolError, match="more than 10000 token ids"):
        for frame in frames:
            joined.feed(parse_message(decode_frame(encode_frame(frame))))


def test_parts_before_a_message_that_carries_none_are_refused() -> None:
    joined = Assembler()
    assert joined.feed(ctl.Part(ids=(1, 2))) is None
    with pytest.raises(ProtocolError, match="carries no parts"):
        joined.feed(ctl.Status())


def test_a_frame_over_the_per_frame_id_cap_is_refused() -> None:
    frame = ctl.Part(ids=tuple(range(ctl.IDS_PER_FRAME + 1))).to_frame()
    with pytest.raises(ProtocolError, match="T <= 8192"):
        parse_message(decode_frame(encode_frame(frame)))


def test_context_and_refusal_failures_stay_typed_both_ways() -> None:
    for exc in (ContextTooLong("over the context"), RequestRefused("out of memory")):
        fail = ctl.fail_of(exc)
        back = parse_message(decode_frame(encode_frame(fail.to_frame())))
        assert isinstance(back, ctl.Fail) and type(back.error()) is type(exc)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), max_size=20_000), st.text(max_size=6000))
def test_any_prompt_survives_the_split(ids: list[int], text: str) -> None:
    req = ctl.Gen(ids=tuple(ids), text=text)
    assert _through_wire(req)[0] == req
