"""A node's identity: one Ed25519 key, stored as its 32-byte seed in a 0600 file.

The same seed gives the libp2p peer ID (net/ builds a libp2p Ed25519 keypair from ``seed``; a
py-libp2p key is a pynacl key underneath, so both agree) and signs what the node publishes
(invites, adverts, plans). The key file lives in the config directory: ``$SHARD_SWARM_CONFIG``,
else ``$XDG_CONFIG_HOME/shard-swarm``, else ``~/.config/shard-swarm``. A key file that the group
or others may read or write is refused (like ssh does), with the ``chmod`` that fixes it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import nacl.exceptions
import nacl.signing

from swarm.errors import ManifestError
from swarm.peerid import (  # re-exported: the identity API
    ED25519_PEER_ID_PREFIX,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from swarm.peerid import (
    b58decode as b58decode,
)
from swarm.peerid import (
    b58encode as b58encode,
)

KEY_FILE = "identity.key"
SEED_BYTES = 32
# protobuf PublicKey{Type: Ed25519(1), Data: 32 bytes} behind an identity multihash (0x00, len 36)


class IdentityError(ManifestError):
    """The node key file is unreadable, malformed or unprotected (exit code 4, like manifests)."""


def is_peer_id(text: str) -> bool:
    try:
        public_key_from_peer_id(text)
    except ValueError:
        return False
    return True


def verify_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True only for a valid Ed25519 signature; never raises for malformed keys or signatures."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        nacl.signing.VerifyKey(public_key).verify(data, signature)
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        return False
    return True


class Identity:
    """An Ed25519 signing key. ``repr``/``str`` show the peer ID only, never the seed."""

    __slots__ = ("_key",)

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise IdentityError(f"an identity seed is {SEED_BYTES} bytes")
        self._key = nacl.signing.SigningKey(seed)

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(SEED_BYTES))

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed: hand it only to the libp2p key constructor."""
        return bytes(self._key)

    @property
    def public_key(self) -> bytes:
        return bytes(self._key.verify_key)

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    @property
    def peer_id_bytes(self) -> bytes:
        """The binary peer ID (identity multihash), as ``libp2p.peer.id.ID(bytes)`` takes it."""
        return ED25519_PEER_ID_PREFIX + self.public_key

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data).signature

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.public_key == self.public_key

    def __hash__(self) -> int:
        return hash(self.public_key)


def config_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$SHARD_SWARM_CONFIG``, else ``$XDG_CONFIG_HOME/shard-swarm``, else ``~/.config/shard-swarm``."""
    env = os.environ if env is None else env
    if env.get("SHARD_SWARM_CONFIG"):
        return Path(env["SHARD_SWARM_CONFIG"]).expanduser()
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]).expanduser() / "shard-swarm"
    return Path.home() / ".config" / "shard-swarm"


def default_key_path(env: Mapping[str, str] | None = None) -> Path:
    return config_dir(env) / KEY_FILE


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (created so, never widened)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_identity(path: Path) -> Identity:
    """Read a key file; IdentityError if missing, the wrong size, or readable by group/others."""
    try:
        st = path.stat()
    except OSError as exc:
        raise IdentityError(f"cannot read key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise IdentityError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise IdentityError(
            f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group/others may access it; "
            f"refusing to use it (fix: chmod 600 {path})"
        )
    try:
        seed = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read key file {path}: {exc.strerror}") from None
    if len(seed) != SEED_BYTES:
        raise IdentityError(
            f"key file {path} holds {len(seed)} bytes, expected a {SEED_BYTES}-byte seed"
        )
    return Identity(seed)


def save_identity(identity: Identity, path: Path) -> None:
    write_private_file(path, identity.seed)


def load_or_create_identity(path: Path | None = None) -> Identity:
    """The node identity at ``path`` (default: the config dir's key file), created on first run."""
    path = default_key_path() if path is None else path
    if not path.exists():
        # Write a temp file, then hard-link it into place: link() fails if another process created
        # the key first, and then both use that one (two nodes starting at once agree on one key).
        identity = Identity.generate()
        tmp = path.with_name(f".{path.name}.new.{os.getpid()}")
        write_private_file(tmp, identity.seed)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise IdentityError(f"cannot create key file {path}: {exc.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return load_identity(path)
