"""The admission handshake: success, and every way to fail it without the secret."""

from __future__ import annotations

import pytest

from swarm.errors import AdmissionError, FrameError, ProtocolError
from swarm.proto.admission import AdmitState, Initiator, Responder, derive_key
from swarm.proto.frame import decode_frame
from swarm.proto.messages import AdmitHello, AdmitResponse, AdmitResult, decode_message

SECRET = b"s" * 32
SWARM = "00112233445566778899aabbccddeeff"
A, B, C = "peerA", "peerB", "peerC"


def _pair(
    i_secret: bytes = SECRET,
    r_secret: bytes = SECRET,
    *,
    i_local: str = A,
    r_remote: str = A,
    **kw: object,
) -> tuple[Initiator, Responder]:
    i = Initiator(secret=i_secret, swarm_id=SWARM, local_peer=i_local, remote_peer=B)
    r = Responder(secret=r_secret, swarm_id=SWARM, local_peer=B, remote_peer=r_remote, **kw)  # type: ignore[arg-type]
    return i, r


def _run(i: Initiator, r: Responder) -> list[bytes]:
    """Pump bytes both ways until neither side has anything to say; returns the transcript."""
    wire = [i.start()]
    to_r = True
    while wire[-1]:
        wire.append((r if to_r else i).receive_data(wire[-1]))
        to_r = not to_r
    return wire


def test_both_sides_admitted() -> None:
    i, r = _pair()
    wire = _run(i, r)
    assert i.admitted and r.admitted and i.error is None and r.error is None
    assert len([w for w in wire if w]) == 4
    assert isinstance(decode_message(wire[3]), AdmitResult)
    i.check()
    r.check()


def test_secret_never_on_the_wire() -> None:
    i, r = _pair()
    blob = b"".join(_run(i, r))
    assert SECRET not in blob and derive_key(SECRET, "/shard-swarm/admit/1 key") not in blob
    assert "s" * 16 not in repr(i) + repr(r)


def test_wrong_secret_initiator_is_refused() -> None:
    i, r = _pair(i_secret=b"x" * 32)
    wire = _run(i, r)
    # the initiator already sees that the responder's proof does not match its secret
    assert i.state is AdmitState.FAILED and "does not hold this swarm's secret" in str(i.error)
    assert r.state is AdmitState.WAIT_RESPONSE
    assert len([w for w in wire if w]) == 2  # hello, challenge: the initiator sends no proof
    with pytest.raises(AdmissionError, match="stream closed"):
        r.eof()


def test_wrong_secret_detected_by_responder() -> None:
    """An initiator that ignores the responder's proof still cannot produce its own."""
    i, r = _pair(i_secret=b"x" * 32)
    challenge = r.receive_data(i.start())
    # a lying initiator: answer with a proof computed from its (wrong) secret anyway
    from swarm.proto.admission import proof, transcript
    from swarm.proto.messages import AdmitChallenge

    ch = decode_message(challenge)
    assert isinstance(ch, AdmitChallenge)
    t = transcript(SWARM, A, B, i._nonce, ch.nonce)
    reply = r.receive_data(AdmitResponse(proof(b"x" * 32, b"I", t)).encode())
    res = decode_message(reply)
    assert isinstance(res, AdmitResult) and not res.ok and res.reason == "refused"
    assert r.state is AdmitState.FAILED
    with pytest.raises(AdmissionError, match="wrong proof"):
        r.check()


def test_impostor_responder_is_caught_by_initiator() -> None:
    i = Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B)
    fake = Responder(secret=b"y" * 32, swarm_id=SWARM, local_peer=B, remote_peer=A)
    out = i.receive_data(fake.receive_data(i.start()))
    assert out == b"" and i.state is AdmitState.FAILED
    with pytest.raises(AdmissionError, match="responder does not hold"):
        i.check()


def test_claiming_another_peer_id_is_refused() -> None:
    # the transport authenticated C, but the hello says A
    i, r = _pair(r_remote=C)
    _run(i, r)
    assert r.state is AdmitState.FAILED and "claims to be peerA" in str(r.error)
    assert i.state is AdmitState.FAILED and "refused by the responder" in str(i.error)


def test_swapped_peer_ids_break_the_proof() -> None:
    """A proof made for (A -> B) is worthless for (B -> A), or for (A -> C)."""
    i, r = _pair()
    hello = i.start()
    challenge = r.receive_data(hello)
    # the same challenge replayed to an initiator that believes it talks to C
    i2 = Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=C)
    i2._nonce = i._nonce  # even with the very same nonce
    i2.start()
    i2.receive_data(challenge)
    assert i2.state is AdmitState.FAILED and "claims to be peerB" in str(i2.error)
    # peers swapped: B initiates towards A with A's old transcript parts
    j = Initiator(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A)
    j._nonce = i._nonce
    j.start()
    r2 = Responder(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B, nonce=r._nonce)
    r2.receive_data(AdmitHello(SWARM, B, i._nonce).encode())
    response = i.receive_data(challenge)  # A's valid response for (A -> B)
    r2.receive_data(response)
    assert r2.state is AdmitState.FAILED and "wrong proof" in str(r2.error)


def test_replayed_response_fails_against_a_fresh_nonce() -> None:
    i, r = _pair()
    wire = _run(i, r)
    hello, response = wire[0], wire[2]
    # an eavesdropper replays the recorded hello and response to the same responder
    r2 = Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A)
    r2.receive_data(hello)
    reply = r2.receive_data(response)
    res = decode_message(reply)
    assert isinstance(res, AdmitResult) and not res.ok
    assert r2.state is AdmitState.FAILED and "wrong proof" in str(r2.error)


def test_replayed_challenge_fails_against_a_fresh_nonce() -> None:
    i, r = _pair()
    challenge = _run(i, r)[1]
    i2 = Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B)
    i2.start()
    assert i2.receive_data(challenge) == b""
    assert i2.state is AdmitState.FAILED and "wrong proof" in str(i2.error)


def test_responder_nonce_reuse_would_be_needed_for_replay() -> None:
    """Control: with the responder's nonce forced equal, the replay would work. This shows the
    responder's fresh nonce is what stops it (the test above is not passing by accident)."""
    i, r = _pair()
    wire = _run(i, r)
    r2 = Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A, nonce=r._nonce)
    r2.receive_data(wire[0])
    r2.receive_data(wire[2])
    assert r2.admitted


def test_wrong_swarm_and_revoked() -> None:
    i = Initiator(secret=SECRET, swarm_id="ff" * 16, local_peer=A, remote_peer=B)
    r = Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A)
    _run(i, r)
    assert r.state is AdmitState.FAILED and "another swarm" in str(r.error)
    i, r = _pair(revoked=frozenset({A}))
    _run(i, r)
    assert r.state is AdmitState.FAILED and "revoked" in str(r.error) and not i.admitted


@pytest.mark.parametrize("cut", [1, 10, 31, 32, 40])
def test_truncated_message(cut: int) -> None:
    i, r = _pair()
    hello = i.start()
    assert r.receive_data(hello[:cut]) == b""  # waits for the rest
    assert r.state is AdmitState.WAIT_HELLO
    with pytest.raises(FrameError, match="ended inside a frame"):
        r.eof()
    assert r.state is AdmitState.FAILED


def test_truncated_meta_inside_a_whole_frame() -> None:
    i, r = _pair()
    hello = bytearray(i.start())
    meta_len = int.from_bytes(hello[24:28], "little")
    hello[24:28] = (meta_len - 5).to_bytes(4, "little")
    with pytest.raises(FrameError, match="invalid JSON"):
        r.receive_data(bytes(hello[:-5]))
    assert r.state is AdmitState.FAILED


def test_out_of_order_and_trailing_messages() -> None:
    i, r = _pair()
    i.start()
    with pytest.raises(ProtocolError, match="unexpected ADMIT_RESPONSE"):
        r.receive_data(AdmitResponse(b"p" * 32).encode())
    assert r.state is AdmitState.FAILED
    i, r = _pair()
    wire = _run(i, r)
    with pytest.raises(ProtocolError, match="after the admission handshake"):
        r.receive_data(wire[0])
    i2, _ = _pair()
    i2.start()
    with pytest.raises(ProtocolError, match="success before the challenge"):
        i2.receive_data(AdmitResult(True).encode())


def test_oversized_handshake_frame_refused() -> None:
    _, r = _pair()
    big = AdmitHello(SWARM, A, b"n" * 32).to_frame()
    from dataclasses import replace

    from swarm.proto.frame import encode_frame

    data = encode_frame(replace(big, meta={**big.meta, "pad": "x" * 3000}))
    with pytest.raises(FrameError, match="max_frame_bytes|max_meta_bytes"):
        r.receive_data(data[:40])
    assert decode_frame(AdmitHello(SWARM, A, b"n" * 32).encode()) is not None


def test_bad_constructor_args() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Initiator(secret=b"short", swarm_id=SWARM, local_peer=A, remote_peer=B)
    with pytest.raises(ValueError, match="nonce"):
        Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A, nonce=b"x")
    i, _ = _pair()
    i.start()
    with pytest.raises(RuntimeError):
        i.start()
