"""Ed25519 signatures over canonical JSON, and the libp2p peer ID of an Ed25519 public key.

Signed objects (adverts, plans) are signed over ``domain + b"\\0" + canonical_json(body)`` where
``body`` is the object without its signature fields. The domain string keeps a signature made for
one purpose from being accepted for another. Canonical JSON: sorted keys, no whitespace, UTF-8,
integers only (no floats: their text form is where encoders disagree).

A *signer* is anything with ``public_key: bytes`` (32) and ``sign(data) -> bytes`` (64):
``swarm.manifest.identity.Identity`` is one. proto may not import manifest, so the peer-ID encoder
here (identity multihash of the protobuf-framed key, base58btc) mirrors the one in
``swarm/manifest/identity.py``; a test checks both against py-libp2p.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Protocol

import nacl.exceptions
import nacl.signing

from swarm.errors import ProtocolError
from swarm.peerid import peer_id_from_public_key
from swarm.proto.frame import canonical_bytes

# protobuf PublicKey{Type: Ed25519(1), Data: 32 bytes} behind an identity multihash (0x00, len 36)


class Signer(Protocol):
    @property
    def public_key(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer ID (base58, ``12D3KooW...``) of a 32-byte Ed25519 public key."""
    try:
        return peer_id_from_public_key(public_key)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


def canonical_json(obj: Any) -> bytes:
    """Deterministic bytes of a JSON value: sorted keys, compact, UTF-8; floats refused."""
    _refuse_floats(obj)
    try:
        return canonical_bytes(obj)
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"value is not canonical JSON: a lone surrogate at char {exc.start}") from None
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"value is not canonical JSON: {exc}") from None


def _refuse_floats(obj: Any) -> None:
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            raise ProtocolError("canonical JSON carries integers only (found a float)")
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: Any, *, field: str, length: int | None = None) -> bytes:
    """Strict standard base64 (with padding); ProtocolError naming ``field`` otherwise."""
    if not isinstance(text, str):
        raise ProtocolError(f"field '{field}': expected base64 text, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ProtocolError(f"field '{field}': not valid base64") from None
    if length is not None and len(raw) != length:
        raise ProtocolError(f"field '{field}': {len(raw)} bytes, expected {length}")
    return raw


def signed_message(domain: str, body: dict[str, Any]) -> bytes:
    return domain.encode("ascii") + b"\0" + canonical_json(body)


def sign_body(signer: Signer, domain: str, body: dict[str, Any]) -> bytes:
    return signer.sign(signed_message(domain, body))


def verify_body(public_key: bytes, domain: str, body: dict[str, Any], signature: bytes) -> bool:
    """True only for a valid Ed25519 signature by ``public_key``; never raises for bad input."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        nacl.signing.VerifyKey(public_key).verify(signed_message(domain, body), signature)
    except (nacl.exceptions.CryptoError, ValueError, TypeError, ProtocolError):
        return False
    return True
