"""Admission handshake: a peer proves it holds the swarm secret, mutually, bound to both peer IDs.

Theory of operation
-------------------
Runs on its own stream (``/shard-swarm/admit/1``) right after the Noise-authenticated libp2p
connection is up, so each side already knows the other's *authenticated* peer ID. Four frames::

    initiator                                responder
    HELLO     {swarm, peer=I, nonce=Ni}  ->
                                         <-  CHALLENGE {peer=R, nonce=Nr, proof=MAC(K, "R" | T)}
    RESPONSE  {proof=MAC(K, "I" | T)}    ->
                                         <-  RESULT {ok, reason}

    K = HMAC-SHA256(secret, "shard-swarm/admit/1 key")
    T = length-prefixed (protocol ID, swarm ID, I, R, Ni, Nr)

Both nonces are 32 fresh random bytes, so every proof is bound to this one exchange: a recorded
response fails against a new challenge, a proof made for a different pair of peers (or the two
peers swapped, or another swarm) fails because T differs, and the role byte stops a proof being
reflected back at its maker. The peer named in HELLO/CHALLENGE must equal the peer ID the
transport authenticated (``remote_peer``), so nobody can be admitted under another's name.
Proofs are compared in constant time. The responder also proves itself, so a joiner never
trusts a node that lacks the secret. Revoked peer IDs are refused before any proof is computed.

Two credentials (roles)
-----------------------
A *member* holds the swarm secret S. A *client* (a party that only runs generations and reads
status) holds a lesser credential derived one way from S, so holding it never reveals S:

    C  = HMAC-SHA256(S, "shard-swarm/client/1 secret")          the client secret
    sk = Ed25519 key from seed HMAC-SHA256(S, "shard-swarm/client/1 member key"); pk = its public key

A client invite carries (C, pk). A client's HELLO says ``role: "client"`` and its transcript
gains that role (``Tc = T | "client"``). The member answers with an Ed25519 signature by sk over
``"R" | Tc`` (a client cannot check a MAC under S, and a MAC under C any client could forge), and
the client proves ``MAC(Kc, "I" | Tc)`` with ``Kc = HMAC-SHA256(C, "shard-swarm/admit/1 client
key")``; the member derives C from S to check it. So a member always knows which credential a
peer proved (:attr:`_Side.peer_role`), a client knows it talks to a member, and a member's
handshake is byte for byte what it was before clients existed. A host that holds only the client
credential admits nobody: it answers every HELLO with a refusal.

Sans-IO: ``receive_data(bytes) -> bytes to send``. A failed *proof* never raises: the side moves
to FAILED, keeps the local reason in ``.error`` (an AdmissionError to log and raise), and the
responder returns a RESULT that tells the remote only "refused". Bytes that break the protocol
raise ProtocolError/FrameError (and also leave the side FAILED). Timeouts are the caller's: every
read on the admit stream must have one (a few seconds).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os

import nacl.exceptions
import nacl.signing

from swarm.errors import AdmissionError, ProtocolError
from swarm.proto.frame import FrameDecoder
from swarm.proto.limits import PROTO_ADMIT, Limits
from swarm.proto.messages import (
    CLIENT_ROLE,
    NONCE_BYTES,
    AdmitChallenge,
    AdmitHello,
    AdmitResponse,
    AdmitResult,
    Message,
    parse_message,
)

# Handshake frames are tiny: refuse anything bigger before authentication.
ADMIT_LIMITS = Limits(
    max_frame_bytes=4096, max_meta_bytes=2048, max_ndim=1, max_json_depth=2, max_list=8
)
REFUSED = "refused"
MEMBER, CLIENT = "member", CLIENT_ROLE
ROLES = (MEMBER, CLIENT)


class AdmitState(enum.Enum):
    IDLE = "idle"  # initiator before start()
    WAIT_HELLO = "wait-hello"  # responder
    WAIT_CHALLENGE = "wait-challenge"  # initiator
    WAIT_RESPONSE = "wait-response"  # responder
    WAIT_RESULT = "wait-result"  # initiator
    ADMITTED = "admitted"
    FAILED = "failed"


def derive_key(secret: bytes, label: str) -> bytes:
    """A 32-byte subkey of the swarm secret for one purpose (``label``); never the secret itself."""
    return hmac.new(secret, label.encode("utf-8"), hashlib.sha256).digest()


def transcript(
    swarm_id: str, initiator: str, responder: str, n_i: bytes, n_r: bytes, role: str = MEMBER
) -> bytes:
    parts = [
        PROTO_ADMIT.encode(),
        swarm_id.encode(),
        initiator.encode(),
        responder.encode(),
        n_i,
        n_r,
    ]
    if role != MEMBER:  # a member's transcript is what it was before roles existed
        parts.append(role.encode())
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def proof(secret: bytes, role: bytes, t: bytes) -> bytes:
    return hmac.new(derive_key(secret, PROTO_ADMIT + " key"), role + t, hashlib.sha256).digest()


def client_secret(secret: bytes) -> bytes:
    """The client credential's secret C, derived one way from the swarm secret S."""
    return derive_key(secret, "shard-swarm/client/1 secret")


def _member_signing_key(secret: bytes) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(derive_key(secret, "shard-swarm/client/1 member key"))


def member_key(secret: bytes) -> bytes:
    """The public key (32 bytes) with which clients check that a peer holds the swarm secret."""
    return bytes(_member_signing_key(secret).verify_key)


def client_proof(client_key: bytes, t: bytes) -> bytes:
    return hmac.new(derive_key(client_key, PROTO_ADMIT + " client key"), b"I" + t, hashlib.sha256).digest()


class _Side:
    def __init__(
        self,
        *,
        secret: bytes,
        swarm_id: str,
        local_peer: str,
        remote_peer: str,
        nonce: bytes | None,
        limits: Limits,
        role: str = MEMBER,
        member_key: bytes = b"",
    ) -> None:
        if len(secret) < 16:
            raise ValueError("swarm secret must be at least 16 bytes")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == CLIENT and len(member_key) != 32:
            raise ValueError("a client needs the swarm's 32-byte member key (from its invite)")
        self._secret = secret  # S for a member, C for a client
        self.role = role
        self._member_key = member_key
        self.peer_role: str | None = None  # the credential the remote proved, once admitted
        self.swarm_id = swarm_id
        self.local_peer = local_peer
        self.remote_peer = remote_peer
        self._nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        if len(self._nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        self._decoder = FrameDecoder(limits)
        self.limits = limits
        self.state = AdmitState.IDLE
        self.error: AdmissionError | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(local={self.local_peer}, remote={self.remote_peer}, state={self.state.value})"

    @property
    def admitted(self) -> bool:
        return self.state is AdmitState.ADMITTED

    @property
    def done(self) -> bool:
        return self.state in (AdmitState.ADMITTED, AdmitState.FAILED)

    def check(self) -> None:
        """Raise the AdmissionError if the handshake failed; no-op otherwise."""
        if self.error is not None:
            raise self.error

    def _fail(self, reason: str) -> None:
        self.state = AdmitState.FAILED
        self.error = AdmissionError(f"admission with {self.remote_peer} failed: {reason}")

    def receive_data(self, data: bytes) -> bytes:
        """Feed bytes from the admit stream; returns the bytes to send back (maybe b"")."""
        if self.done:
            if data:
                raise ProtocolError(
                    f"peer {self.remote_peer} sent bytes after the admission handshake ended"
                )
            return b""
        out = b""
        try:
            for frame in self._decoder.feed(data):
                if self.done:
                    raise ProtocolError(
                        f"peer {self.remote_peer} sent bytes after the admission handshake ended"
                    )
                out += self._handle(parse_message(frame, self.limits))
        except ProtocolError:
            self.state = AdmitState.FAILED
            raise
        return out

    def eof(self) -> None:
        """The stream closed. ProtocolError if that was mid-frame; AdmissionError if unfinished."""
        try:
            self._decoder.eof()
        except ProtocolError:
            self.state = AdmitState.FAILED
            raise
        if not self.done:
            self._fail(f"stream closed in state {self.state.value}")
        self.check()

    def _handle(self, msg: Message) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError


class Initiator(_Side):
    """The dialing side. ``start()`` gives the HELLO to send."""

    def __init__(
        self, *, secret: bytes, swarm_id: str, local_peer: str, remote_peer: str,
        nonce: bytes | None = None, limits: Limits = ADMIT_LIMITS, role: str = MEMBER, member_key: bytes = b"",
    ) -> None:  # fmt: skip
        super().__init__(
            secret=secret, swarm_id=swarm_id, local_peer=local_peer, remote_peer=remote_peer,
            nonce=nonce, limits=limits, role=role, member_key=member_key,
        )  # fmt: skip

    def start(self) -> bytes:
        if self.state is not AdmitState.IDLE:
            raise RuntimeError("Initiator.start() called twice")
        self.state = AdmitState.WAIT_CHALLENGE
        role = None if self.role == MEMBER else self.role  # a member's HELLO names no role
        return AdmitHello(self.swarm_id, self.local_peer, self._nonce, role).encode(self.limits)

    def _responder_proved(self, msg: AdmitChallenge, t: bytes) -> bool:
        if self.role == CLIENT:
            if not msg.sig:
                return False
            try:
                nacl.signing.VerifyKey(self._member_key).verify(b"R" + t, msg.sig)
            except nacl.exceptions.BadSignatureError:
                return False
            return True
        return msg.proof is not None and hmac.compare_digest(proof(self._secret, b"R", t), msg.proof)

    def _handle(self, msg: Message) -> bytes:
        if self.state is AdmitState.WAIT_CHALLENGE and isinstance(msg, AdmitChallenge):
            if msg.peer_id != self.remote_peer:
                self._fail(
                    f"responder claims to be {msg.peer_id[:64]}, transport says {self.remote_peer}"
                )
                return b""
            t = transcript(self.swarm_id, self.local_peer, self.remote_peer, self._nonce, msg.nonce, self.role)
            if not self._responder_proved(msg, t):
                self._fail("the responder does not hold this swarm's secret (wrong proof)")
                return b""
            self.state = AdmitState.WAIT_RESULT
            mine = client_proof(self._secret, t) if self.role == CLIENT else proof(self._secret, b"I", t)
            return AdmitResponse(mine).encode(self.limits)
        if isinstance(msg, AdmitResult) and self.state in (
            AdmitState.WAIT_CHALLENGE,
            AdmitState.WAIT_RESULT,
        ):
            if msg.ok and self.state is AdmitState.WAIT_RESULT:
                self.state = AdmitState.ADMITTED
                self.peer_role = MEMBER  # both credentials prove a responder holds S
            elif msg.ok:
                raise ProtocolError(
                    f"peer {self.remote_peer} reported success before the challenge"
                )
            else:
                self._fail(f"refused by the responder ({msg.reason[:64] or 'no reason'})")
            return b""
        raise ProtocolError(
            f"unexpected {msg.TYPE.name} from {self.remote_peer} in state {self.state.value}"
        )


class Responder(_Side):
    """The listening side. ``revoked``: peer IDs the manifest excludes."""

    def __init__(
        self, *, secret: bytes, swarm_id: str, local_peer: str, remote_peer: str,
        nonce: bytes | None = None, limits: Limits = ADMIT_LIMITS, revoked: frozenset[str] = frozenset(),
        role: str = MEMBER, member_key: bytes = b"",
    ) -> None:  # fmt: skip
        super().__init__(
            secret=secret, swarm_id=swarm_id, local_peer=local_peer, remote_peer=remote_peer,
            nonce=nonce, limits=limits, role=role, member_key=member_key,
        )  # fmt: skip
        self.revoked = revoked
        self.state = AdmitState.WAIT_HELLO
        self._t = b""
        self._hello_role = MEMBER

    def _refuse(self, reason: str) -> bytes:
        self._fail(reason)
        return AdmitResult(False, REFUSED).encode(self.limits)

    def _handle(self, msg: Message) -> bytes:
        if self.state is AdmitState.WAIT_HELLO and isinstance(msg, AdmitHello):
            if msg.swarm_id != self.swarm_id:
                return self._refuse(f"it asked for another swarm ({msg.swarm_id[:64]!r})")
            if msg.peer_id != self.remote_peer:
                return self._refuse(
                    f"it claims to be {msg.peer_id[:64]} but the transport says {self.remote_peer}"
                )
            if msg.peer_id in self.revoked:
                return self._refuse("its peer ID is revoked by the swarm manifest")
            if self.role == CLIENT:
                return self._refuse("this host holds only a client credential: it admits nobody")
            self._hello_role = msg.role or MEMBER
            self._t = transcript(
                self.swarm_id, self.remote_peer, self.local_peer, msg.nonce, self._nonce, self._hello_role
            )
            self.state = AdmitState.WAIT_RESPONSE
            if self._hello_role == CLIENT:
                sig = _member_signing_key(self._secret).sign(b"R" + self._t).signature
                return AdmitChallenge(self.local_peer, self._nonce, None, sig).encode(self.limits)
            return AdmitChallenge(
                self.local_peer, self._nonce, proof(self._secret, b"R", self._t)
            ).encode(self.limits)
        if self.state is AdmitState.WAIT_RESPONSE and isinstance(msg, AdmitResponse):
            if self._hello_role == CLIENT:
                expected = client_proof(client_secret(self._secret), self._t)
            else:
                expected = proof(self._secret, b"I", self._t)
            if not hmac.compare_digest(expected, msg.proof):
                what = "the client credential" if self._hello_role == CLIENT else "this swarm's secret"
                return self._refuse(f"it does not hold {what} (wrong proof)")
            self.state = AdmitState.ADMITTED
            self.peer_role = self._hello_role
            return AdmitResult(True, "").encode(self.limits)
        raise ProtocolError(
            f"unexpected {msg.TYPE.name} from {self.remote_peer} in state {self.state.value}"
        )
