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

from swarm.errors import AdmissionError, ProtocolError
from swarm.proto.frame import FrameDecoder
from swarm.proto.limits import PROTO_ADMIT, Limits
from swarm.proto.messages import (
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


def transcript(swarm_id: str, initiator: str, responder: str, n_i: bytes, n_r: bytes) -> bytes:
    parts = [
        PROTO_ADMIT.encode(),
        swarm_id.encode(),
        initiator.encode(),
        responder.encode(),
        n_i,
        n_r,
    ]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def proof(secret: bytes, role: bytes, t: bytes) -> bytes:
    return hmac.new(derive_key(secret, PROTO_ADMIT + " key"), role + t, hashlib.sha256).digest()


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
    ) -> None:
        if len(secret) < 16:
            raise ValueError("swarm secret must be at least 16 bytes")
        self._secret = secret
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
        nonce: bytes | None = None, limits: Limits = ADMIT_LIMITS,
    ) -> None:  # fmt: skip
        super().__init__(
            secret=secret,
            swarm_id=swarm_id,
            local_peer=local_peer,
            remote_peer=remote_peer,
            nonce=nonce,
            limits=limits,
        )

    def start(self) -> bytes:
        if self.state is not AdmitState.IDLE:
            raise RuntimeError("Initiator.start() called twice")
        self.state = AdmitState.WAIT_CHALLENGE
        return AdmitHello(self.swarm_id, self.local_peer, self._nonce).encode(self.limits)

    def _handle(self, msg: Message) -> bytes:
        if self.state is AdmitState.WAIT_CHALLENGE and isinstance(msg, AdmitChallenge):
            if msg.peer_id != self.remote_peer:
                self._fail(
                    f"responder claims to be {msg.peer_id[:64]}, transport says {self.remote_peer}"
                )
                return b""
            t = transcript(self.swarm_id, self.local_peer, self.remote_peer, self._nonce, msg.nonce)
            if not hmac.compare_digest(proof(self._secret, b"R", t), msg.proof):
                self._fail("the responder does not hold this swarm's secret (wrong proof)")
                return b""
            self.state = AdmitState.WAIT_RESULT
            return AdmitResponse(proof(self._secret, b"I", t)).encode(self.limits)
        if isinstance(msg, AdmitResult) and self.state in (
            AdmitState.WAIT_CHALLENGE,
            AdmitState.WAIT_RESULT,
        ):
            if msg.ok and self.state is AdmitState.WAIT_RESULT:
                self.state = AdmitState.ADMITTED
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
    ) -> None:  # fmt: skip
        super().__init__(
            secret=secret,
            swarm_id=swarm_id,
            local_peer=local_peer,
            remote_peer=remote_peer,
            nonce=nonce,
            limits=limits,
        )
        self.revoked = revoked
        self.state = AdmitState.WAIT_HELLO
        self._t = b""

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
            self._t = transcript(
                self.swarm_id, self.remote_peer, self.local_peer, msg.nonce, self._nonce
            )
            self.state = AdmitState.WAIT_RESPONSE
            return AdmitChallenge(
                self.local_peer, self._nonce, proof(self._secret, b"R", self._t)
            ).encode(self.limits)
        if self.state is AdmitState.WAIT_RESPONSE and isinstance(msg, AdmitResponse):
            if not hmac.compare_digest(proof(self._secret, b"I", self._t), msg.proof):
                return self._refuse("it does not hold this swarm's secret (wrong proof)")
            self.state = AdmitState.ADMITTED
            return AdmitResult(True, "").encode(self.limits)
        raise ProtocolError(
            f"unexpected {msg.TYPE.name} from {self.remote_peer} in state {self.state.value}"
        )
