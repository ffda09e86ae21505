"""Admission with the two credentials: a member (the swarm secret) and a client (the client
secret and member key of a client invite, derived one way from the swarm secret)."""

from __future__ import annotations

import hashlib

import pytest

from swarm.proto.admission import (
    CLIENT,
    MEMBER,
    AdmitState,
    Initiator,
    Responder,
    client_secret,
    member_key,
)
from swarm.proto.messages import AdmitChallenge, AdmitHello, decode_message
from tests.proto.test_admission import _run

SECRET = hashlib.sha256(b"the swarm secret").digest()
SWARM = "00112233445566778899aabbccddeeff"
A, B = "peerA", "peerB"
CSECRET, MKEY = client_secret(SECRET), member_key(SECRET)


def _client(secret: bytes = CSECRET, key: bytes = MKEY, **kw: object) -> Initiator:
    return Initiator(secret=secret, swarm_id=SWARM, local_peer=A, remote_peer=B, role=CLIENT, member_key=key, **kw)  # type: ignore[arg-type]


def _member_responder(secret: bytes = SECRET, **kw: object) -> Responder:
    return Responder(secret=secret, swarm_id=SWARM, local_peer=B, remote_peer=A, **kw)  # type: ignore[arg-type]


def test_the_client_credential_never_reveals_the_secret() -> None:
    assert len(CSECRET) == 32 and len(MKEY) == 32
    assert CSECRET != SECRET and MKEY != SECRET and SECRET not in CSECRET + MKEY
    assert client_secret(SECRET) == CSECRET  # deterministic: every member derives the same


def test_a_client_is_admitted_as_a_client_and_sees_a_member() -> None:
    i, r = _client(), _member_responder()
    wire = _run(i, r)
    assert i.admitted and r.admitted
    assert r.peer_role == CLIENT and i.peer_role == MEMBER
    blob = b"".join(wire)
    assert SECRET not in blob and CSECRET not in blob
    hello = decode_message(wire[0])
    assert isinstance(hello, AdmitHello) and hello.role == CLIENT
    challenge = decode_message(wire[1])
    assert isinstance(challenge, AdmitChallenge) and challenge.sig is not None and len(challenge.sig) == 64 and challenge.proof is None


def test_a_member_is_admitted_as_a_member_with_unchanged_bytes() -> None:
    nonce_i, nonce_r = b"i" * 32, b"r" * 32
    i = Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B, nonce=nonce_i)
    r = Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A, nonce=nonce_r)
    wire = _run(i, r)
    assert r.peer_role == MEMBER and i.peer_role == MEMBER
    assert b"role" not in wire[0] and b"sig" not in wire[1]  # a member's handshake is what it was


def test_a_client_secret_used_as_a_member_secret_is_refused() -> None:
    i = Initiator(secret=CSECRET, swarm_id=SWARM, local_peer=A, remote_peer=B)  # claims member with C
    r = _member_responder()
    _run(i, r)
    assert not i.admitted and not r.admitted


def test_a_client_cannot_pose_as_a_member_to_another_client() -> None:
    """The holder of a client invite knows C but not S: it cannot sign as a member."""
    i = _client()
    rogue = Responder(secret=CSECRET, swarm_id=SWARM, local_peer=B, remote_peer=A, role=CLIENT, member_key=MKEY)
    _run(i, rogue)
    assert not i.admitted and not rogue.admitted
    # nor by answering with a MAC under the client key (what it can compute) in place of the signature
    i2 = _client()
    hello = i2.start()
    r = _member_responder()
    real = decode_message(r.receive_data(hello))
    assert isinstance(real, AdmitChallenge)
    forged = AdmitChallenge(B, real.nonce, b"\x00" * 32)
    i2.receive_data(forged.encode())
    assert i2.state is AdmitState.FAILED and "wrong proof" in str(i2.error)


def test_a_wrong_member_key_or_client_secret_fails() -> None:
    other = hashlib.sha256(b"another swarm").digest()
    i = _client(key=member_key(other))
    _run(i, _member_responder())
    assert not i.admitted  # the member's signature does not check under another key
    i = _client(secret=client_secret(other))
    r = _member_responder()
    _run(i, r)
    assert i.state is AdmitState.FAILED and "refused by the responder" in str(i.error)
    assert not r.admitted and "client credential" in str(r.error)


def test_a_host_with_only_the_client_credential_admits_nobody() -> None:
    for initiator in (Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B), _client()):
        r = Responder(secret=CSECRET, swarm_id=SWARM, local_peer=B, remote_peer=A, role=CLIENT, member_key=MKEY)
        _run(initiator, r)
        assert not r.admitted and "admits nobody" in str(r.error)


def test_a_client_proof_replayed_as_a_member_proof_fails() -> None:
    """The client's proof is under another key and another transcript: it is no member proof."""
    i = _client()
    r_client_side = _member_responder()
    hello = i.start()
    challenge = r_client_side.receive_data(hello)
    response = i.receive_data(challenge)
    # the same nonces, but a HELLO without the client role: the member expects a member's MAC
    stripped = AdmitHello(SWARM, A, decode_message(hello).nonce).encode()  # type: ignore[union-attr]
    r = Responder(secret=SECRET, swarm_id=SWARM, local_peer=B, remote_peer=A,
                  nonce=decode_message(challenge).nonce)  # type: ignore[union-attr]  # fmt: skip
    r.receive_data(stripped)
    r.receive_data(response)
    assert not r.admitted and r.state is AdmitState.FAILED


def test_bad_role_arguments() -> None:
    with pytest.raises(ValueError, match="role"):
        Initiator(secret=SECRET, swarm_id=SWARM, local_peer=A, remote_peer=B, role="admin")
    with pytest.raises(ValueError, match="member key"):
        Initiator(secret=CSECRET, swarm_id=SWARM, local_peer=A, remote_peer=B, role=CLIENT)
