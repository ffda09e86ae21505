"""/shard-swarm/tensors/1's messages: round trips, every bound, the asker's order checks."""

from __future__ import annotations

import pytest

from swarm.errors import FrameError, ProtocolError
from swarm.proto import DEFAULT_LIMITS, Limits, decode_message
from swarm.proto.frame import DType, Flag, Frame, MsgType, encode_frame
from swarm.proto.messages import parse_message
from swarm.proto.tensors import RangeData, RangeReader, RangeRefused, RangeRequest, data_frames

SMALL = Limits(max_range_chunk=8)


def test_request_data_and_refusal_round_trip() -> None:
    for msg in (RangeRequest(1, "model-00001-of-00003.safetensors", 8, 100),
                RangeData.of(1, 8, b"\x00\xff" * 4, last=True),
                RangeRefused(1, "not-held", "bytes [8, 108) are not held")):  # fmt: skip
        assert decode_message(msg.encode()) == msg


@pytest.mark.parametrize(
    "meta, session",
    [({"file": "a", "offset": 0, "length": 0}, 1),  # an empty range
     ({"file": "a", "offset": -1, "length": 1}, 1),
     ({"file": "a", "offset": 1 << 56 + 1, "length": 1}, 1),
     ({"file": "", "offset": 0, "length": 1}, 1),
     ({"file": "a" * 1025, "offset": 0, "length": 1}, 1),
     ({"file": "a", "offset": 0, "length": 1, "extra": 1}, 1),
     ({"file": "a", "offset": 0, "length": 1}, 0)],  # request id 0 is reserved
)  # fmt: skip
def test_a_request_out_of_bounds_is_refused(meta: dict[str, object], session: int) -> None:
    with pytest.raises(ProtocolError):
        parse_message(Frame(MsgType.RANGE_REQUEST, session=session, meta=meta))


def test_data_frames_are_bounded_u8_pieces() -> None:
    frames = data_frames(5, 100, bytes(range(20)), SMALL)
    assert [len(f.data) for f in frames] == [8, 8, 4] and [f.last for f in frames] == [False, False, True]
    assert [f.offset for f in frames] == [100, 108, 116]
    for f in frames:
        assert parse_message(f.to_frame(), SMALL) == f
    over = Frame(MsgType.RANGE_DATA, session=5, dtype=DType.U8, shape=(9,), meta={"offset": 0}, payload=bytes(9))
    with pytest.raises(ProtocolError, match="max_range_chunk"):
        parse_message(over, SMALL)
    wide = Frame(MsgType.RANGE_DATA, session=5, dtype=DType.FP32, shape=(2,), meta={"offset": 0}, payload=bytes(8))
    with pytest.raises(ProtocolError, match="U8"):
        parse_message(wide, SMALL)


@pytest.mark.parametrize("offset, n, last", [(0, 1, True), (100, 8, False), ((1 << 56) - 1, 1 << 20, True)])
def test_a_data_head_followed_by_its_bytes_is_the_encoded_frame(offset: int, n: int, last: bool) -> None:
    """What a member sends from its own buffer (head, then the bytes read after it) is exactly
    the frame it would have encoded, under the same frame caps."""
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    head = RangeData.head(7, offset, n, last, DEFAULT_LIMITS)
    assert head + data == encode_frame(RangeData.of(7, offset, data, last).to_frame())
    assert decode_message(head + data) == RangeData.of(7, offset, data, last)
    with pytest.raises(FrameError, match="max_frame_bytes"):
        RangeData.head(7, offset, n, last, Limits(max_frame_bytes=n + 8))


def test_a_u8_frame_is_never_an_activation() -> None:
    f = Frame(MsgType.CHUNK, session=1, dtype=DType.U8, shape=(2, 4), meta={"pos": 0, "mode": "decode"}, payload=bytes(8))
    with pytest.raises(ProtocolError, match="U8"):
        parse_message(f, DEFAULT_LIMITS)


def test_an_unknown_refusal_code_is_refused() -> None:
    with pytest.raises(ProtocolError):
        parse_message(Frame(MsgType.RANGE_REFUSED, session=1, meta={"code": "maybe"}))


def test_the_reader_takes_pieces_in_order_and_ends_at_the_end() -> None:
    req = RangeRequest(3, "f", 10, 20)
    r = RangeReader(req)
    got = b"".join(r.take(f) for f in data_frames(3, 10, bytes(20), SMALL))
    assert got == bytes(20) and r.done
    with pytest.raises(ProtocolError, match="after its LAST"):
        r.take(RangeData.of(3, 30, b"x", last=True))
    for bad in (RangeData.of(3, 11, b"x" * 8, last=False),  # skips a byte
                RangeData.of(4, 10, b"x" * 8, last=False),  # another request
                RangeData.of(3, 10, b"x" * 8, last=True),  # LAST too early
                RangeData.of(3, 10, b"x" * 21, last=True),  # past the end
                RangeRefused(3, "busy")):  # fmt: skip
        with pytest.raises(ProtocolError):
            RangeReader(req).take(bad)
    r = RangeReader(RangeRequest(3, "f", 0, 8))
    r.take(RangeData(3, 0, DType.U8, (8,), bytes(8), int(Flag.LAST)))
    assert r.done
