"""Frames: round trips, every header field, every cap at / under / over its limit."""

from __future__ import annotations

import struct

import pytest

from swarm.errors import FrameError
from swarm.proto.frame import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    DType,
    Flag,
    Frame,
    FrameDecoder,
    MsgType,
    decode_frame,
    decode_meta,
    encode_frame,
    encode_meta,
    payload_bytes,
)
from swarm.proto.limits import DEFAULT_LIMITS, Limits


def _frame(dtype: DType = DType.FP32, shape: tuple[int, ...] = (2, 3), **kw: object) -> Frame:
    n = 1
    for d in shape:
        n *= d
    args: dict[object, object] = dict(
        msg_type=MsgType.CHUNK, session=7, seq=9, dtype=dtype, shape=shape,
        meta={"pos": 1}, payload=bytes(n * dtype.itemsize),
    )  # fmt: skip
    args.update(kw)
    return Frame(**args)  # type: ignore[arg-type]


def _raw_header(**kw: int | bytes) -> bytes:
    f = dict(magic=MAGIC, version=1, type=int(MsgType.HEARTBEAT), flags=0, dtype=0, ndim=0, reserved=0,
             session=0, seq=0, meta_len=0, payload_len=0)  # fmt: skip
    f.update(kw)
    return HEADER.pack(*f.values())


@pytest.mark.parametrize("dtype", [d for d in DType if d is not DType.NONE])
def test_round_trip_every_dtype(dtype: DType) -> None:
    payload = bytes((i * 37) % 256 for i in range(24 * dtype.itemsize))
    f = _frame(dtype, (2, 3, 4), payload=payload, flags=int(Flag.LAST))
    data = encode_frame(f)
    assert len(data) == HEADER_SIZE + 3 * 4 + len(b'{"pos":1}') + len(payload)
    assert decode_frame(data) == f


def test_header_is_32_bytes_little_endian() -> None:
    data = encode_frame(Frame(MsgType.HEARTBEAT, session=1, seq=0x0102030405060708, meta={"t": 1}))
    assert HEADER_SIZE == 32 and data[:2] == MAGIC
    assert data[16:24] == bytes([8, 7, 6, 5, 4, 3, 2, 1])


def test_no_tensor_frame_and_empty_meta() -> None:
    f = Frame(MsgType.SESSION_END, session=3)
    data = encode_frame(f)
    assert len(data) == HEADER_SIZE
    assert decode_frame(data) == f


def test_decoder_byte_by_byte_and_many_per_feed() -> None:
    frames = [_frame(seq=i) for i in range(5)]
    blob = b"".join(encode_frame(f) for f in frames)
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(blob)):
        got += dec.feed(blob[i : i + 1])
    assert got == frames and dec.buffered == 0
    assert FrameDecoder().feed(blob) == frames


def test_decoder_keeps_partial_frame() -> None:
    data = encode_frame(_frame())
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == []
    assert dec.buffered == len(data) - 1
    assert dec.feed(data[-1:]) == [_frame()]


def test_eof_inside_frame_is_an_error() -> None:
    data = encode_frame(_frame())
    dec = FrameDecoder()
    dec.feed(data[:10])
    with pytest.raises(FrameError, match="ended inside a frame"):
        dec.eof()
    FrameDecoder().eof()  # clean end: no error


def test_decoder_stays_broken_after_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(FrameError, match="magic"):
        dec.feed(b"XX" + bytes(30))
    with pytest.raises(FrameError, match="closed after an earlier error"):
        dec.feed(encode_frame(_frame()))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"HT"}, "'magic'"),
        ({"version": 2}, "'version'"),
        ({"type": 0x7E}, "'type'"),
        ({"flags": 0x80}, "'flags'"),
        ({"dtype": 9}, "'dtype'"),
        ({"reserved": 1}, "'reserved'"),
        ({"dtype": 0, "ndim": 1}, "'dtype'"),
        ({"dtype": 0, "payload_len": 4}, "'dtype'"),
        ({"dtype": 3, "ndim": 0}, "'ndim'"),
        ({"ndim": 5, "dtype": 3}, "max_ndim"),
        ({"meta_len": DEFAULT_LIMITS.max_meta_bytes + 1}, "max_meta_bytes"),
        ({"dtype": 3, "ndim": 1, "payload_len": 0xFFFFFFFF}, "max_frame_bytes"),
    ],
)
def test_bad_header_fields(fields: dict[str, int | bytes], match: str) -> None:
    with pytest.raises(FrameError, match=match):
        FrameDecoder().feed(_raw_header(**fields))


def test_oversized_frame_refused_from_header_alone() -> None:
    """A header announcing 4 GiB is refused before any body byte arrives (nothing buffered)."""
    dec = FrameDecoder()
    with pytest.raises(FrameError, match="max_frame_bytes"):
        dec.feed(_raw_header(dtype=3, ndim=1, payload_len=0xFFFFFFF0))
    assert dec.buffered == 0


def test_payload_length_must_match_shape() -> None:
    good = encode_frame(_frame(DType.FP32, (2, 3)))
    bad = bytearray(good)
    struct.pack_into("<I", bad, 28, 20)  # payload_len 24 -> 20
    with pytest.raises(FrameError, match="payload_len"):
        FrameDecoder().feed(bytes(bad[:-4]))
    with pytest.raises(FrameError, match="payload_len"):
        encode_frame(_frame(DType.FP32, (2, 3), payload=bytes(20)))


def test_frame_bytes_at_under_over_limit() -> None:
    f = _frame(DType.INT32, (10,), meta={})
    size = len(encode_frame(f))
    assert (
        decode_frame(encode_frame(f, Limits(max_frame_bytes=size)), Limits(max_frame_bytes=size))
        == f
    )
    encode_frame(f, Limits(max_frame_bytes=size + 1))
    with pytest.raises(FrameError, match="max_frame_bytes"):
        encode_frame(f, Limits(max_frame_bytes=size - 1))
    with pytest.raises(FrameError, match="max_frame_bytes"):
        decode_frame(encode_frame(f), Limits(max_frame_bytes=size - 1))


@pytest.mark.parametrize(("n", "ok"), [(3, True), (4, True), (5, False)])
def test_ndim_at_under_over_limit(n: int, ok: bool) -> None:
    lim = Limits(max_ndim=4)
    f = _frame(DType.INT32, (1,) * n, meta={})
    data = encode_frame(f, Limits(max_ndim=8))
    if ok:
        assert decode_frame(data, lim) == f
    else:
        with pytest.raises(FrameError, match="max_ndim"):
            decode_frame(data, lim)


@pytest.mark.parametrize(("elements", "ok"), [(99, True), (100, True), (101, False)])
def test_elements_at_under_over_limit(elements: int, ok: bool) -> None:
    lim = Limits(max_elements=100)
    f = _frame(DType.BF16, (elements,), meta={})
    data = encode_frame(f)
    if ok:
        assert decode_frame(data, lim) == f
    else:
        with pytest.raises(FrameError, match="max_elements"):
            decode_frame(data, lim)
        with pytest.raises(FrameError, match="max_elements"):
            encode_frame(f, lim)


@pytest.mark.parametrize(("dim", "ok"), [(15, True), (16, True), (17, False)])
def test_dim_at_under_over_limit(dim: int, ok: bool) -> None:
    lim = Limits(max_dim=16)
    f = _frame(DType.INT64, (1, dim), meta={})
    if ok:
        assert decode_frame(encode_frame(f), lim) == f
    else:
        with pytest.raises(FrameError, match=r"shape\[1\].*max_dim"):
            decode_frame(encode_frame(f), lim)


def test_zero_sized_dims_are_fine_at_frame_level() -> None:
    f = _frame(DType.FP16, (0, 8), meta={})
    assert decode_frame(encode_frame(f)) == f


def test_meta_bytes_at_under_over_limit() -> None:
    meta = {"k": "x" * 100}
    size = len(encode_meta(meta))
    f = Frame(MsgType.HEARTBEAT, meta=meta)
    assert decode_frame(encode_frame(f), Limits(max_meta_bytes=size)) == f
    with pytest.raises(FrameError, match="max_meta_bytes"):
        decode_frame(encode_frame(f), Limits(max_meta_bytes=size - 1))
    with pytest.raises(FrameError, match="max_meta_bytes"):
        encode_meta(meta, Limits(max_meta_bytes=size - 1))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"[1,2]", "JSON object"),
        (b'{"a":1,"a":2}', "duplicate key"),
        (b'{"a":NaN}', "NaN"),
        (b'{"a":Infinity}', "Infinity"),
        (b'{"a":1e999}', "non-finite"),
        (b'{"a":', "invalid JSON"),
        (b'{"a":"\xff"}', "not UTF-8"),
        (b'{"a":' + b"9" * 5000 + b"}", "invalid JSON"),
        (b'{"a":' + b"9" * 30 + b"}", "64-bit"),
        (b'{"a":' + b"[" * 20 + b"]" * 20 + b"}", "max_json_depth"),
        (b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", "max_json_depth"),
        (b'{"a":"' + b"x" * 5000 + b'"}', "max_string"),
        (b'{"a":[' + b"1," * 2000 + b"1]}", "max_list"),
    ],
)
def test_meta_is_parsed_strictly(raw: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_meta(raw)


def test_meta_depth_at_limit() -> None:
    lim = Limits(max_json_depth=3)
    assert decode_meta(b'{"a":{"b":[1]}}', lim) == {"a": {"b": [1]}}
    with pytest.raises(FrameError, match="max_json_depth"):
        decode_meta(b'{"a":{"b":[[1]]}}', lim)


def test_encode_refuses_what_a_receiver_would() -> None:
    with pytest.raises(FrameError, match="flags"):
        encode_frame(Frame(MsgType.HEARTBEAT, flags=0x40))
    with pytest.raises(FrameError, match="session"):
        encode_frame(Frame(MsgType.HEARTBEAT, session=1 << 64))
    with pytest.raises(FrameError, match="non-finite"):
        encode_frame(Frame(MsgType.HEARTBEAT, meta={"x": float("nan")}))
    with pytest.raises(FrameError, match="unsupported value type"):
        encode_frame(Frame(MsgType.HEARTBEAT, meta={"x": object()}))


def test_decode_frame_wants_exactly_one() -> None:
    data = encode_frame(_frame())
    with pytest.raises(FrameError, match="exactly one frame"):
        decode_frame(data + data)
    with pytest.raises(FrameError, match="exactly one frame"):
        decode_frame(data[:-1])


def test_repr_never_dumps_payload() -> None:
    f = _frame(DType.INT32, (4,), payload=b"SECRETTOKENS1234")
    assert "SECRET" not in repr(f) and "16B" in repr(f)


def test_decode_frame_can_hand_the_payload_as_a_view_of_the_message() -> None:
    f = _frame(DType.U8, (5,), payload=b"abcde")
    data = encode_frame(f)
    copied, viewed = decode_frame(data), decode_frame(data, view=True)
    assert isinstance(copied.payload, bytes) and isinstance(viewed.payload, memoryview)
    assert copied.payload == bytes(viewed.payload) == b"abcde" and viewed.meta == copied.meta == f.meta
    assert viewed.payload.obj is data  # no copy: a view into the (immutable) message


def test_a_byte_view_payload_is_encoded_like_bytes_and_any_other_buffer_is_copied() -> None:
    import array

    raw = b"0123456789abcdef"
    view = memoryview(raw)[4:12]
    assert payload_bytes(view) is view
    assert encode_frame(_frame(DType.U8, (8,), payload=view)) == encode_frame(_frame(DType.U8, (8,), payload=raw[4:12]))
    wide = memoryview(array.array("i", [1, 2]))  # 4-byte items: len() counts 2, the payload is 8 bytes
    assert payload_bytes(wide) == bytes(wide) and len(payload_bytes(wide)) == 8
