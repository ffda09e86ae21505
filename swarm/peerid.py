"""libp2p peer IDs of Ed25519 keys, without libp2p: base58 and the identity-multihash prefix.

A leaf module (standard library only), shared like ``swarm.errors`` by ``manifest`` (identity
keys, invite issuers) and ``proto`` (signed adverts and plans), which may not import each other.
"""

from __future__ import annotations

# identity multihash (0x00, length 36) of a protobuf PublicKey {Type: Ed25519, Data: 32 bytes}
ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    if not text or len(text) > 128:
        raise ValueError("base58 text must be 1..128 chars")
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise ValueError(f"{c!r} is not a base58 character")
        n = n * 58 + _B58_INDEX[c]
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def peer_id_from_public_key(public_key: bytes) -> str:
    """libp2p peer ID (``12D3KooW...``) of a 32-byte Ed25519 public key; ValueError otherwise."""
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    return b58encode(ED25519_PEER_ID_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The Ed25519 public key inside a peer ID; ValueError if it is not an Ed25519 peer ID."""
    raw = b58decode(peer_id)
    if len(raw) != len(ED25519_PEER_ID_PREFIX) + 32 or not raw.startswith(ED25519_PEER_ID_PREFIX):
        raise ValueError(f"{peer_id[:64]!r} is not an Ed25519 libp2p peer ID")
    return raw[len(ED25519_PEER_ID_PREFIX) :]
