"""Messages: round trips of every type and the per-type schema checks."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.errors import BadRequest, FrameError, ProtocolError
from swarm.proto import control as ctl
from swarm.proto.frame import DType, Frame, MsgType, decode_frame, encode_frame
from swarm.proto.limits import Limits
from swarm.proto.messages import (
    MESSAGE_TYPES,
    AdmitChallenge,
    AdmitHello,
    AdmitResponse,
    AdmitResult,
    Advert,
    Chunk,
    Error,
    Heartbeat,
    Message,
    Plan,
    Result,
    Rollback,
    SessionEnd,
    decode_message,
    parse_message,
)
from swarm.proto.tensors import RangeData, RangeRefused, RangeRequest

PEER = "12D3KooWD527tGVJ6SFGnFEZsR4vuwx2u9xQwf1Dg6WoyHRS1Dgi"

SAMPLES: list[Message] = [
    AdmitHello("00ff" * 8, PEER, b"n" * 32),
    AdmitChallenge(PEER, b"n" * 32, b"p" * 32),
    AdmitResponse(b"p" * 32),
    AdmitResult(True, ""),
    AdmitResult(False, "refused"),
    Advert(
        PEER,
        b"k" * 32,
        "00ff" * 8,
        5,
        ("/ip4/127.0.0.1/tcp/4001",),
        "cuda",
        "RTX 4090",
        24 << 30,
        850,
        {PEER: 1400},
        b"s" * 64,
    ),  # fmt: skip
    Heartbeat(12, 123456789),
    Plan(3, {"ring": [PEER], "blocks": [[0, 30]]}),
    Plan(4, {"ring": []}, b"k" * 32, b"s" * 64),
    Chunk(1, 2, 0, "prefill", DType.INT32, (5,), bytes(20)),
    Chunk(1, 3, 5, "verify", DType.INT64, (2, 4), bytes(64), epoch=2, flags=1),
    Chunk(9, 4, 7, "decode", DType.BF16, (1, 3, 8), bytes(48)),
    Chunk(9, 5, 7, "decode", DType.FP32, (3, 8), bytes(96)),
    Result(1, 2, 0, "hidden", DType.FP16, (5, 8), bytes(80)),
    Result(1, 2, 0, "tokens", DType.INT32, (1, 5), bytes(20)),
    Rollback(1, 42, epoch=1),
    SessionEnd(1),
    Error(1, 2, "bad_tensor", "NaN in hidden states"),
    Error(0, 0, "overloaded"),
    ctl.Gen.checked((1, 2, 3), max_new_tokens=8),
    ctl.Status(),
    RangeRequest(1, "model.safetensors", 8, 4096),
    RangeData.of(1, 8, bytes(16), last=False),
    RangeRefused(1, "too-large", "at most 16 MiB a request"),
]
RAN = {"spans": [64, 128], "eager_from": 128, "eager": None, "dtype": "bf16"}  # how a stage ran (StageRun)
# one sample of every CONTROL op (all CONTROL frames: their class is the op's)
CONTROLS: list[ctl.Control] = [
    ctl.Loaded(3), ctl.Connect(3), ctl.Linked({"0": "direct", "1": "relayed via x"}), ctl.Serve(3, {"0": "local"}),
    ctl.Loaded(3, RAN), ctl.Serve(3, {}, {PEER: RAN, "x": {**RAN, "spans": [], "eager": "no --compile"}}),
    ctl.Ack(), ctl.Current(), ctl.NoPlan(), ctl.NoPlan(2, {"ring": [PEER]}), ctl.Ended(2), ctl.Leaving(),
    ctl.Leave(), ctl.Fault(PEER, 3, "NaN"), ctl.BadBytes(PEER, "model-00001.safetensors: tensor x failed sha256"), ctl.Hop(3, 1), ctl.Probe(2), SAMPLES[19],  # type: ignore[list-item]
    ctl.Gen.checked(text="hi", chat=True, temperature=0.7, top_p=0.9, top_k=5, seed=3, draft="none", depth=2,
                    draft_k=4, wait_s=1.5),
    ctl.Tokens((7, 8), "ab"), ctl.Notice("paused"), ctl.Done({"output_token_ids": [1]}),
    ctl.Part((1, 2, 3), "some text"), ctl.Progress(128, 6000),
    SAMPLES[20], ctl.Status(coordinator=True, loop_window_s=5),  # type: ignore[list-item]
    ctl.StatusReply({"epoch": 1}), ctl.Fail("busy", "full", 5), ctl.Fail("bad_request"),
]  # fmt: skip


def test_every_type_has_a_parser_and_a_sample() -> None:
    assert set(MESSAGE_TYPES) == set(MsgType)
    assert {m.TYPE for m in SAMPLES} == set(MESSAGE_TYPES)
    assert {type(m) for m in SAMPLES if m.TYPE is not MsgType.CONTROL} == set(MESSAGE_TYPES.values()) - {ctl.Control}
    assert {type(m) for m in CONTROLS} == set(ctl.OPS.values())


@pytest.mark.parametrize("msg", CONTROLS, ids=lambda m: type(m).__name__)
def test_control_round_trip(msg: ctl.Control) -> None:
    assert decode_message(msg.encode()) == msg


def test_set_up_replies_without_compiled_stages_carry_no_compiled_field() -> None:
    """A node that does not compile answers loaded as before, and a serve with no stage's report
    has no compiled field: a peer of an older version, which refuses fields it does not know, meets
    the field only from nodes started with --compile."""
    assert ctl.Loaded(3).to_frame().meta["body"] == {"epoch": 3}
    assert "compiled" not in ctl.Serve(3, {"0": "direct"}).to_frame().meta["body"]


@pytest.mark.parametrize(
    ("msg", "changes", "match"),
    [
        (ctl.Connect(3), {"epoch": -1}, "CONTROL connect field 'epoch': -1 outside"),
        (ctl.Connect(3), {"epoch": (1 << 62) + 1}, "CONTROL connect field 'epoch': 4611686018427387905 outside"),
        (ctl.Connect(3), {"extra": 1}, "CONTROL connect field 'extra': unknown field"),
        (ctl.Fault(PEER, 3), {"peer": ...}, "CONTROL fault field 'peer': missing"),
        (ctl.Hop(3, 1), {"hop": "1"}, "CONTROL hop field 'hop': expected an integer"),
        (ctl.Linked({}), {"hops": {"0": 5}}, "CONTROL linked field 'hops'"),
        (SAMPLES[19], {"temperature": 2.5}, r"CONTROL gen field 'temperature': expected a number in \[0, 2\]"),
        (SAMPLES[19], {"top_p": 0}, r"CONTROL gen field 'top_p': expected a number in \(0, 1\]"),
        (SAMPLES[19], {"max_new_tokens": 4097}, "CONTROL gen field 'max_new_tokens': 4097 outside 1..4096"),
        (SAMPLES[19], {"draft": "magic"}, "CONTROL gen field 'draft': 'magic' not one of"),
        (ctl.Fail("busy"), {"code": "no spaces"}, "CONTROL fail field 'code'"),
        (ctl.Loaded(3, RAN), {"compiled": {**RAN, "spans": [64, "128"]}}, "loaded field 'compiled': spans: expected a list"),
        (ctl.Loaded(3, RAN), {"compiled": {**RAN, "eager": "also eager"}}, "'compiled': expected compiled spans, or why"),
        (ctl.Loaded(3, RAN), {"compiled": {**RAN, "dtype": "int4"}}, "'compiled': dtype: expected one of fp32"),
        (ctl.Loaded(3, RAN), {"compiled": {"spans": [64]}}, "'compiled': expected an object of exactly spans"),
        (ctl.Serve(3, {}, {PEER: RAN}), {"compiled": {PEER: {**RAN, "eager_from": -1}}},
         f"CONTROL serve field 'compiled': stage '{PEER}': eager_from: expected a position"),
    ],
)
def test_control_schema_violations_name_the_op_and_field(
    msg: ctl.Control, changes: dict[str, object], match: str
) -> None:
    frame = msg.to_frame()
    body = dict(frame.meta["body"])
    for k, v in changes.items():
        if v is ...:
            body.pop(k)
        else:
            body[k] = v
    bad = dataclasses.replace(frame, meta={**frame.meta, "body": body})
    with pytest.raises(ProtocolError, match=match):
        parse_message(bad)
    with pytest.raises(ProtocolError, match=match):
        decode_message(encode_frame(bad))


def test_control_envelope_is_checked() -> None:
    good = ctl.Status().to_frame()
    for frame, match in [
        (dataclasses.replace(good, meta={"op": "launch", "body": {}}), "CONTROL field 'op': 'launch' not one of"),
        (dataclasses.replace(good, meta={"op": "status"}), "CONTROL field 'body': expected a JSON object"),
        (dataclasses.replace(good, meta={**good.meta, "x": 1}), "CONTROL field 'x': unknown field"),
        (dataclasses.replace(good, session=5), "CONTROL field 'session': 5, must be 0"),
        (dataclasses.replace(good, dtype=DType.INT32, shape=(1,), payload=bytes(4)), "CONTROL status field 'dtype'"),
        (dataclasses.replace(SAMPLES[19].to_frame(), dtype=DType.FP32), "CONTROL gen field 'dtype': FP32"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            parse_message(frame)


def test_a_local_generation_request_is_checked_against_the_same_bounds() -> None:
    assert ctl.Gen.checked(temperature=2, top_p=1e-9).temperature == 2.0
    for fields, name in [({"temperature": 2.01}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"seed": -1}, "seed"),
                         ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
                         ({"draft": "x"}, "draft"), ({"frobnicate": 1}, "frobnicate")]:  # fmt: skip
        with pytest.raises(BadRequest) as info:
            ctl.Gen.checked(**fields)
        assert info.value.field == name, (fields, info.value)
    with pytest.raises(BadRequest, match="token ids"):
        ctl.Gen.checked([1, "2"])  # type: ignore[list-item]
    resumed = ctl.Gen.checked((1, 2), max_new_tokens=10).resumed([5, 6, 7])
    assert resumed.ids == (1, 2, 5, 6, 7) and resumed.max_new_tokens == 7


def test_fail_codes_map_to_one_error_type_each_way() -> None:
    from swarm.errors import (
        Busy,
        CannotServe,
        Forbidden,
        PeerError,
        PeerTimeout,
        PlanningError,
        UsageError,
    )

    for exc, code, back in [
        (Busy("full", 7), "busy", Busy), (PlanningError("3 GB short"), "cannot_serve", CannotServe),
        (Forbidden("no"), "forbidden", Forbidden), (UsageError("bad"), "bad_request", BadRequest),
        (ProtocolError("junk"), "bad_request", BadRequest), (PeerTimeout("slow"), "unavailable", PeerError),
    ]:  # fmt: skip
        fail = decode_message(ctl.fail_of(exc).encode())
        assert isinstance(fail, ctl.Fail) and fail.code == code and fail.message == str(exc)
        err = fail.error("peer x: ")
        assert type(err) is back and str(err) == f"peer x: {exc}"
    busy = ctl.fail_of(Busy("full", 7)).error()
    assert isinstance(busy, Busy) and busy.retry_after_s == 7


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    assert decode_message(msg.encode()) == msg


def _with_meta(message: Message, **changes: object) -> Frame:
    f = message.to_frame()
    meta = dict(f.meta)
    for k, v in changes.items():
        if v is ...:
            meta.pop(k)
        else:
            meta[k] = v
    return dataclasses.replace(f, meta=meta)


@pytest.mark.parametrize(
    ("msg", "changes", "match"),
    [
        (SAMPLES[0], {"nonce": ...}, "ADMIT_HELLO field 'nonce': missing"),
        (SAMPLES[0], {"nonce": "AAAA"}, "ADMIT_HELLO field 'nonce': 3 bytes, expected 32"),
        (SAMPLES[0], {"nonce": "not base64!"}, "'nonce': not valid base64"),
        (SAMPLES[0], {"extra": 1}, "ADMIT_HELLO field 'extra': unknown field"),
        (SAMPLES[0], {"peer": 5}, "'peer': expected a string"),
        (SAMPLES[0], {"peer": "x" * 129}, "'peer': 129 chars over the limit 128"),
        (SAMPLES[2], {"proof": "QQ=="}, "ADMIT_RESPONSE field 'proof'"),
        (SAMPLES[3], {"ok": 1}, "'ok': expected true/false"),
        (SAMPLES[5], {"seq": 6}, "disagrees with the header"),
        (SAMPLES[5], {"addrs": ["tcp://x"]}, "'addrs'"),
        (SAMPLES[5], {"device": {"kind": "cpu"}}, "'device'"),
        (SAMPLES[5], {"memory": -1}, "'memory': -1 outside"),
        (SAMPLES[5], {"memory": True}, "'memory': expected an integer"),
        (SAMPLES[5], {"rtt_us": {PEER: 1.5}}, "'rtt_us'"),
        (SAMPLES[5], {"sig": ...}, "'sig': missing"),
        (SAMPLES[6], {"t": -5}, "HEARTBEAT field 't'"),
        (SAMPLES[7], {"plan": [1]}, "PLAN field 'plan': expected a JSON object"),
        (SAMPLES[8], {"sig": ...}, "signer and sig come together"),
        (SAMPLES[9], {"mode": "turbo"}, "CHUNK field 'mode': 'turbo' not one of"),
        (SAMPLES[9], {"pos": -1}, "CHUNK field 'pos'"),
        (SAMPLES[13], {"kind": "tokens"}, "RESULT field 'kind': tokens does not match dtype FP16"),
        (SAMPLES[15], {"len": "1"}, "ROLLBACK field 'len'"),
        (SAMPLES[16], {"x": 1}, "SESSION_END field 'x': unknown"),
        (SAMPLES[17], {"code": "no spaces"}, "ERROR field 'code'"),
        (SAMPLES[17], {"msg": ...}, "ERROR field 'msg': missing"),
        (SAMPLES[9], {"epoch": ...}, "CHUNK field 'epoch': missing"),
    ],
)
def test_schema_violations_name_the_field(
    msg: Message, changes: dict[str, object], match: str
) -> None:
    frame = _with_meta(msg, **changes)
    with pytest.raises(ProtocolError, match=match):
        parse_message(frame)
    # and the same through the bytes path
    with pytest.raises(ProtocolError, match=match):
        decode_message(encode_frame(frame))


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (
            Frame(
                MsgType.HEARTBEAT, dtype=DType.INT32, shape=(1,), payload=bytes(4), meta={"t": 1}
            ),
            "carries no tensor",
        ),
        (Frame(MsgType.ADVERT, session=4, meta={}), "'session': 4, must be 0"),
        (
            Frame(MsgType.CHUNK, session=1, meta={"pos": 0, "mode": "decode", "epoch": 0}),
            "'dtype': NONE",
        ),
        (
            Frame(MsgType.CHUNK, session=0, dtype=DType.INT32, shape=(1,), payload=bytes(4)),
            "'session': 0 is reserved",
        ),
        (Frame(MsgType.ROLLBACK, session=0, meta={"len": 1, "epoch": 0}), "'session': 0"),
        (
            Frame(MsgType.CHUNK, 1, 0, 0, DType.INT32, (1, 2, 3), {}, bytes(24)),
            r"token ids are \(T,\) or \(B, T\)",
        ),
        (
            Frame(MsgType.CHUNK, 1, 0, 0, DType.FP32, (4,), {}, bytes(16)),
            r"hidden states are \(T, D\)",
        ),
        (Frame(MsgType.CHUNK, 1, 0, 0, DType.FP32, (4, 0), {}, b""), "hidden size 0"),
        (Frame(MsgType.CHUNK, 1, 0, 0, DType.INT32, (0,), {}, b""), "0 tokens outside"),
    ],
)
def test_header_use_per_type(frame: Frame, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_message(frame)


@pytest.mark.parametrize(("t", "ok"), [(7, True), (8, True), (9, False)])
def test_tokens_per_chunk_at_under_over_limit(t: int, ok: bool) -> None:
    lim = Limits(max_tokens_per_chunk=8)
    for msg in (
        Chunk(1, 1, 0, "verify", DType.INT32, (t,), bytes(4 * t)),
        Chunk(1, 1, 0, "verify", DType.BF16, (1, t, 4), bytes(8 * t)),
    ):
        if ok:
            assert decode_message(msg.encode(), lim) == msg
        else:
            with pytest.raises(ProtocolError, match="max_tokens_per_chunk"):
                decode_message(msg.encode(), lim)


@pytest.mark.parametrize(("b", "ok"), [(3, True), (4, True), (5, False)])
def test_batch_at_under_over_limit(b: int, ok: bool) -> None:
    lim = Limits(max_batch=4)
    msg = Chunk(1, 1, 0, "decode", DType.INT64, (b, 1), bytes(8 * b))
    if ok:
        assert decode_message(msg.encode(), lim) == msg
    else:
        with pytest.raises(ProtocolError, match="max_batch"):
            decode_message(msg.encode(), lim)


@pytest.mark.parametrize(("pos", "ok"), [(95, True), (96, True), (97, False)])
def test_position_at_under_over_limit(pos: int, ok: bool) -> None:
    lim = Limits(max_position=100)
    msg = Chunk(1, 1, pos, "verify", DType.INT32, (4,), bytes(16))  # covers pos .. pos+3
    if ok:
        assert decode_message(msg.encode(), lim) == msg
    else:
        with pytest.raises(ProtocolError, match="'pos'"):
            decode_message(msg.encode(), lim)
    with pytest.raises(ProtocolError, match="'len'"):
        decode_message(Rollback(1, 101).encode(), lim)


def test_advert_limits() -> None:
    adv = SAMPLES[5]
    assert isinstance(adv, Advert)
    many = dataclasses.replace(adv, addrs=tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(3)))
    assert decode_message(many.encode(), Limits(max_addresses=3)) == many
    with pytest.raises(ProtocolError, match="at most 2 multiaddrs"):
        decode_message(many.encode(), Limits(max_addresses=2))
    rtts = dataclasses.replace(adv, rtt_us={f"p{i}": i for i in range(3)})
    with pytest.raises(ProtocolError, match="at most 2 peers"):
        decode_message(rtts.encode(), Limits(max_peers=2))


def test_frame_errors_pass_through_decode_message() -> None:
    with pytest.raises(FrameError):
        decode_message(b"SW" + bytes(3))
    with pytest.raises(FrameError):
        decode_frame(b"")


def test_reprs_hide_proofs_and_tensor_bytes() -> None:
    assert "p" * 32 not in repr(SAMPLES[1]) and "p" * 8 not in repr(SAMPLES[2])
    assert "\\x00" not in repr(SAMPLES[9]) and "INT32[5]" in repr(SAMPLES[9])
