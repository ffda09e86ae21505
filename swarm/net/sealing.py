"""Fast-path cryptography, pure functions and objects (no sockets): see fastpath.py.

* :class:`Cipher` / :data:`CIPHERS`: the AEADs both sides may pick (AEGIS-256 first when
  libsodium has it, ChaCha20-Poly1305-IETF always), and :class:`Sealer`, one direction's AEAD
  sealing into and opening from caller-owned buffers.
* :class:`Hello`: the two handshake messages, strictly decoded (caps on size, address count and
  length; any malformed input raises ProtocolError naming the peer).
* :func:`derive_keys`: transcript hash and per-direction keys bound to the X25519 secret, both
  peer IDs and both hellos.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from nacl import bindings as sodium
from nacl.encoding import RawEncoder
from nacl.exceptions import CryptoError
from nacl.hash import blake2b
from nacl.public import PrivateKey

from swarm.errors import ProtocolError

PROTOCOL_ID = "/shard-swarm/direct/1"
MAGIC = b"SSFP"
VERSION = 1
MAX_HELLO = 1024
MAX_ADDRS = 8
MAX_ADDR_LEN = 64
SID_LEN = 16
MAC_LEN = 32


@dataclass(frozen=True)
class Cipher:
    ident: int  # wire code in the hellos
    name: str
    symbol: str  # libsodium function prefix
    key_len: int
    nonce_len: int
    tag_len: int


def _ciphers() -> dict[int, Cipher]:
    found = {
        2: Cipher(2, "chacha20-poly1305-ietf", "crypto_aead_chacha20poly1305_ietf", 32, 12, 16)
    }
    if hasattr(sodium, "crypto_aead_aegis256_encrypt"):
        found[1] = Cipher(1, "aegis256", "crypto_aead_aegis256", 32, 32, 32)
    return found


class Sealer:
    """One direction's AEAD with caller-owned buffers.

    Calls pynacl's bundled libsodium through its cffi ``lib`` (the same C functions that
    ``nacl.bindings`` wraps): the public wrappers allocate the output, copy it and format
    error strings on every call, which costs 25-35 us per frame here — more than sealing
    8 KiB. Falls back to ``nacl.bindings`` if the cffi module is not importable.
    """

    def __init__(self, cipher: Cipher, key: bytes) -> None:
        if len(key) != cipher.key_len:
            raise ValueError(f"{cipher.name} needs a {cipher.key_len}-byte key")
        self.cipher = cipher
        self.key = key
        self.tag = cipher.tag_len
        try:
            from nacl._sodium import ffi, lib

            self._ffi: Any = ffi
            self._enc: Any = getattr(lib, cipher.symbol + "_encrypt")
            self._dec: Any = getattr(lib, cipher.symbol + "_decrypt")
            self._len: Any = ffi.new("unsigned long long *")
        except (ImportError, AttributeError):  # pragma: no cover - older pynacl layouts
            self._ffi = None
            self._enc = getattr(sodium, cipher.symbol + "_encrypt")
            self._dec = getattr(sodium, cipher.symbol + "_decrypt")

    def seal_into(
        self, out: memoryview, plain: bytes | memoryview, aad: bytes, nonce: bytes
    ) -> int:
        """Write ciphertext+tag of ``plain`` into ``out``; returns its length."""
        n = len(plain) + self.tag
        if self._ffi is None:  # pragma: no cover
            out[:n] = self._enc(bytes(plain), aad, nonce, self.key)
            return n
        ffi = self._ffi
        rc = self._enc(
            ffi.from_buffer(out), self._len, ffi.from_buffer(plain), len(plain),
            aad, len(aad), ffi.NULL, nonce, self.key,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"libsodium {self.cipher.symbol}_encrypt failed ({rc})")
        return n

    def open_into(self, out: memoryview, sealed: memoryview, aad: bytes, nonce: bytes) -> bool:
        """Decrypt ``sealed`` into ``out`` (len(sealed) - tag bytes); False if the tag fails."""
        if self._ffi is None:  # pragma: no cover
            try:
                plain = self._dec(bytes(sealed), aad, nonce, self.key)
            except CryptoError:
                return False
            out[: len(plain)] = plain
            return True
        ffi = self._ffi
        rc = self._dec(
            ffi.from_buffer(out, require_writable=True), self._len, ffi.NULL,
            ffi.from_buffer(sealed), len(sealed), aad, len(aad), nonce, self.key,
        )  # fmt: skip
        return bool(rc == 0)


CIPHERS = _ciphers()
# preference order: fastest first
DEFAULT_CIPHERS: tuple[str, ...] = tuple(
    c.name for c in sorted(CIPHERS.values(), key=lambda c: c.ident)
)
CIPHERS_BY_NAME = {c.name: c for c in CIPHERS.values()}


# ----------------------------------------------------------------------------- handshake (pure)


@dataclass(frozen=True)
class Hello:
    ephemeral: bytes
    ciphers: tuple[int, ...]
    addresses: tuple[str, ...] = ()

    def encode(self) -> bytes:
        out = bytearray(MAGIC)
        out.append(VERSION)
        out += self.ephemeral
        out.append(len(self.ciphers))
        out += bytes(self.ciphers)
        out.append(len(self.addresses))
        for a in self.addresses:
            raw = a.encode()
            out.append(len(raw))
            out += raw
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes, peer: str) -> Hello:
        def bad(what: str) -> ProtocolError:
            return ProtocolError(f"peer {peer} sent a malformed fast-path hello: {what}")

        if len(data) > MAX_HELLO:
            raise bad(f"{len(data)} bytes, over the cap of {MAX_HELLO}")
        if len(data) < 4 + 1 + 32 + 2 or data[:4] != MAGIC:
            raise bad("bad magic or too short")
        if data[4] != VERSION:
            raise bad(f"version {data[4]}, this node speaks {VERSION}")
        eph = data[5:37]
        pos = 37
        nc = data[pos]
        pos += 1
        ciphers = tuple(data[pos : pos + nc])
        pos += nc
        if len(ciphers) != nc or nc == 0:
            raise bad("cipher list truncated or empty")
        if pos >= len(data):
            raise bad("address count missing")
        na = data[pos]
        pos += 1
        if na > MAX_ADDRS:
            raise bad(f"{na} addresses, over the cap of {MAX_ADDRS}")
        addrs = []
        for _ in range(na):
            if pos >= len(data):
                raise bad("address list truncated")
            ln = data[pos]
            pos += 1
            raw = data[pos : pos + ln]
            pos += ln
            if len(raw) != ln or ln > MAX_ADDR_LEN:
                raise bad("address truncated or too long")
            try:
                addr = raw.decode()
                parse_address(addr)
            except (UnicodeDecodeError, ValueError) as exc:
                raise bad(f"address {raw!r}: {exc}") from exc
            addrs.append(addr)
        if pos != len(data):
            raise bad(f"{len(data) - pos} trailing bytes")
        return cls(eph, ciphers, tuple(addrs))


def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError when malformed."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class SessionKeys:
    """Everything both sides derive from one handshake; ``send``/``recv`` are role-relative."""

    cipher: Cipher
    transcript: bytes
    session_id: bytes
    send: bytes
    recv: bytes
    proof_i: bytes  # MAC the initiator opens the direct socket with
    proof_r: bytes  # MAC the listener answers with

    def __repr__(self) -> str:  # never print key material
        return f"SessionKeys(cipher={self.cipher.name}, session={self.session_id.hex()})"


def _lp(b: bytes) -> bytes:
    return struct.pack(">H", len(b)) + b


def derive_keys(
    *,
    initiator: bool,
    shared: bytes,
    initiator_id: str,
    responder_id: str,
    hello_i: bytes,
    hello_r: bytes,
    cipher: Cipher,
) -> SessionKeys:
    """Keys bound to the DH secret, both peer IDs and both hellos (the transcript)."""
    transcript = blake2b(
        _lp(PROTOCOL_ID.encode())
        + _lp(initiator_id.encode())
        + _lp(responder_id.encode())
        + _lp(hello_i)
        + _lp(hello_r),
        digest_size=32,
        person=b"ssfp-transcript",
        encoder=RawEncoder,
    )

    def kdf(label: bytes, size: int = 32) -> bytes:
        return blake2b(transcript, digest_size=size, key=shared, person=label, encoder=RawEncoder)

    i2r, r2i = kdf(b"ssfp-key-i2r", cipher.key_len), kdf(b"ssfp-key-r2i", cipher.key_len)
    pi, pr = kdf(b"ssfp-proof-i"), kdf(b"ssfp-proof-r")
    session_id = blake2b(
        transcript, digest_size=SID_LEN, person=b"ssfp-session", encoder=RawEncoder
    )
    proof_i = blake2b(transcript, digest_size=MAC_LEN, key=pi, encoder=RawEncoder)
    proof_r = blake2b(transcript, digest_size=MAC_LEN, key=pr, encoder=RawEncoder)
    return SessionKeys(
        cipher=cipher,
        transcript=transcript,
        session_id=session_id,
        send=i2r if initiator else r2i,
        recv=r2i if initiator else i2r,
        proof_i=proof_i,
        proof_r=proof_r,
    )


def dh(secret: PrivateKey, public: bytes, peer: str) -> bytes:
    try:
        shared: bytes = sodium.crypto_scalarmult(bytes(secret), public)
    except Exception as exc:  # libsodium refuses low-order points (all-zero result)
        raise ProtocolError(f"peer {peer} sent an invalid X25519 ephemeral key") from exc
    if shared == bytes(32):
        raise ProtocolError(f"peer {peer} sent a low-order X25519 ephemeral key")
    return shared
