"""Fuzz invariant (issue 8): any input either parses or raises the project's own error.

Never another exception, never a hang, never unbounded buffering. Inputs that once broke the
invariant live in ``corpus/`` and are replayed by ``test_corpus`` (frame-*, admit-* and
manifest-* files; see corpus/README.md).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import AdmissionError, FrameError, ManifestError, ProtocolError
from swarm.manifest.manifest import parse_manifest, verify_manifest
from swarm.proto.admission import ADMIT_LIMITS, Initiator, Responder
from swarm.proto.frame import HEADER_SIZE, DType, Frame, FrameDecoder, MsgType, encode_frame
from swarm.proto.limits import Limits
from swarm.proto.messages import Message, parse_message

from .test_messages import SAMPLES

CORPUS = Path(__file__).parent / "corpus"
SMALL = Limits(max_frame_bytes=4096, max_meta_bytes=1024, max_elements=512, max_tokens_per_chunk=16)
# SWARM_FUZZ_EXAMPLES=5000 for a deeper campaign (CI nightly, or after touching a parser)
FUZZ = settings(
    max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def consume(data: bytes, cuts: list[int], limits: Limits = SMALL) -> list[Message]:
    """Feed ``data`` in pieces cut at ``cuts``; parse every frame. Only our errors may escape."""
    dec = FrameDecoder(limits)
    out: list[Message] = []
    prev = 0
    for c in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        for frame in dec.feed(data[prev:c]):
            out.append(parse_message(frame, limits))
        prev = c
        assert dec.buffered <= limits.max_frame_bytes
    dec.eof()
    return out


def _ours(fn: object, *args: object) -> None:
    with contextlib.suppress(FrameError, ProtocolError):
        fn(*args)  # type: ignore[operator]


@FUZZ
@given(st.binary(max_size=2048), st.lists(st.integers(0, 2048), max_size=8))
def test_any_bytes_any_split(data: bytes, cuts: list[int]) -> None:
    _ours(consume, data, cuts)


@FUZZ
@given(st.binary(min_size=HEADER_SIZE - 30, max_size=600))
def test_any_bytes_after_a_valid_magic(tail: bytes) -> None:
    _ours(consume, b"SW\x01" + tail, [])


mutation = st.tuples(st.integers(0, 4096), st.integers(0, 255))


@FUZZ
@given(
    st.sampled_from(SAMPLES),
    st.lists(mutation, max_size=6),
    st.integers(0, 1 << 12),
    st.lists(st.integers(0, 600), max_size=4),
)
def test_mutated_valid_messages(
    msg: Message, flips: list[tuple[int, int]], cut: int, cuts: list[int]
) -> None:
    data = bytearray(msg.encode())
    for pos, val in flips:
        data[pos % len(data)] = val
    _ours(consume, bytes(data[: max(cut, HEADER_SIZE)]), cuts)


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.text(max_size=20)
    | st.floats()
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
meta_keys = st.sampled_from(
    ["pos", "mode", "epoch", "kind", "len", "t", "code", "msg", "peer", "swarm", "nonce", "proof", "ok",
     "reason", "key", "seq", "addrs", "device", "memory", "layer_us", "rtt_us", "sig", "plan", "signer", "op", "body"]
)  # fmt: skip


@FUZZ
@given(
    st.sampled_from(list(MsgType)),
    st.sampled_from(list(DType)),
    st.lists(st.integers(0, 20), max_size=4),
    st.dictionaries(meta_keys, json_value, max_size=8),
    st.integers(0, 3),
    st.integers(0, 1 << 64 - 1),
)
def test_structured_frames_through_every_parser(
    mtype: MsgType, dtype: DType, shape: list[int], meta: dict[str, object], session: int, seq: int
) -> None:
    n = 1
    for d in shape:
        n *= d
    shp = tuple(shape) if dtype is not DType.NONE else ()
    frame = Frame(mtype, session, seq, 0, dtype, shp, meta, bytes(n * dtype.itemsize if shp else 0))
    try:
        data = encode_frame(frame, SMALL)
    except FrameError:
        return
    _ours(consume, data, [])
    _ours(parse_message, frame, SMALL)


@FUZZ
@given(st.binary(max_size=1024), st.lists(st.integers(0, 1024), max_size=4), st.booleans())
def test_admission_sides_take_any_bytes(data: bytes, cuts: list[int], initiator: bool) -> None:
    side: Initiator | Responder
    if initiator:
        side = Initiator(secret=b"s" * 32, swarm_id="x", local_peer="A", remote_peer="B")
        side.start()
    else:
        side = Responder(secret=b"s" * 32, swarm_id="x", local_peer="B", remote_peer="A")
    prev = 0
    try:
        for c in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
            out = side.receive_data(data[prev:c])
            assert len(out) <= ADMIT_LIMITS.max_frame_bytes
            prev = c
        side.eof()
    except (FrameError, ProtocolError, AdmissionError):
        pass


@FUZZ
@given(st.binary(max_size=1024))
def test_manifest_parser_any_bytes(data: bytes) -> None:
    with contextlib.suppress(ManifestError):
        verify_manifest(parse_manifest(data), now=0)


def test_corpus() -> None:
    files = sorted(p for p in CORPUS.iterdir() if p.suffix == ".bin")
    assert files, "corpus is empty"
    for path in files:
        data = path.read_bytes()
        if path.name.startswith("manifest-"):
            try:
                verify_manifest(parse_manifest(data), now=0)
            except ManifestError:
                continue
        elif path.name.startswith("admit-"):
            side = Responder(secret=b"s" * 32, swarm_id="x", local_peer="B", remote_peer="A")
            _ours(side.receive_data, data)
        else:
            _ours(consume, data, [], Limits())
            _ours(consume, data, list(range(len(data))), Limits())



# Text fields from peers (issue 14): a lone surrogate or a control character in a string or a
# key is the sender's fault (FrameError / ProtocolError), never an exception that ends the node.
_ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=())


@FUZZ
@given(st.text(alphabet=_ANY_CHAR, max_size=40))
def test_error_text_any_code_points(text: str) -> None:
    from swarm.proto.messages import Error

    try:
        wire = encode_frame(Error(1, 2, "bad_input", text).to_frame())
    except FrameError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)  # only a lone surrogate is refused
        return
    assert parse_message(FrameDecoder(SMALL).feed(wire)[0], SMALL) == Error(1, 2, "bad_input", text)


@FUZZ
@given(st.text(alphabet=_ANY_CHAR, max_size=8), st.text(alphabet=_ANY_CHAR, max_size=8))
def test_escaped_meta_any_code_units(key: str, value: str) -> None:
    """JSON escapes can spell any UTF-16 code unit; what decodes must encode again."""
    from swarm.proto.frame import decode_meta, encode_meta

    def esc(s: str) -> str:
        return "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in s)

    raw = ('{"' + esc(key) + '":"' + esc(value) + '"}').encode("utf-8", "surrogatepass")
    try:
        meta = decode_meta(raw, SMALL)
    except FrameError:
        return
    assert decode_meta(encode_meta(meta, SMALL), SMALL) == meta


def test_a_lone_surrogate_from_upstream_is_a_frame_error() -> None:
    from swarm.proto.frame import decode_meta, encode_meta
    from swarm.proto.messages import Error

    for raw in (b'{"code":"x","msg":"\\ud800"}', b'{"\\udfff":1}'):
        try:
            decode_meta(raw)
        except FrameError as exc:
            assert "surrogate" in str(exc)
        else:
            raise AssertionError(f"accepted {raw!r}")
    for build in (lambda: encode_meta({"msg": "\ud800"}), lambda: encode_frame(Error(1, 2, "x", "\udfff").to_frame())):
        try:
            build()
        except FrameError as exc:
            assert "surrogate" in str(exc)
        else:
            raise AssertionError("a lone surrogate was encoded")
