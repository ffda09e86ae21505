"""Node identity: creation, 0600 storage, refusal of unprotected keys, peer IDs, no seed in reprs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swarm.manifest.identity import (
    Identity,
    IdentityError,
    b58decode,
    b58encode,
    config_dir,
    load_identity,
    load_or_create_identity,
    public_key_from_peer_id,
    verify_signature,
)


def test_config_dir_precedence(tmp_path: Path) -> None:
    assert (
        config_dir({"SHARD_SWARM_CONFIG": str(tmp_path / "a"), "XDG_CONFIG_HOME": "/x"})
        == tmp_path / "a"
    )
    assert config_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "shard-swarm"
    assert config_dir({}) == Path.home() / ".config" / "shard-swarm"


def test_created_on_first_run_with_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_bytes() == first.seed and len(first.seed) == 32
    assert load_or_create_identity(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp files left


def test_default_path_uses_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path))
    ident = load_or_create_identity()
    assert (tmp_path / "identity.key").read_bytes() == ident.seed


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o602])
def test_group_or_world_accessible_key_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    os.chmod(path, mode)
    with pytest.raises(IdentityError, match=f"mode {mode:04o}.*chmod 600 {path}"):
        load_identity(path)


def test_malformed_key_files(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    with pytest.raises(IdentityError, match="cannot read"):
        load_identity(path)
    path.write_bytes(b"x" * 31)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="31 bytes"):
        load_identity(path)
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        load_identity(tmp_path / "dir")


def test_sign_and_verify() -> None:
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert len(sig) == 64 and verify_signature(ident.public_key, b"hello", sig)
    assert not verify_signature(ident.public_key, b"hellO", sig)
    assert not verify_signature(Identity.generate().public_key, b"hello", sig)
    assert not verify_signature(ident.public_key[:31], b"hello", sig)
    assert not verify_signature(b"\xff" * 32, b"hello", sig)


def test_seed_never_in_repr() -> None:
    ident = Identity(bytes(range(32)))
    text = repr(ident) + str(ident) + f"{ident}"
    assert ident.peer_id in text
    assert bytes(range(32)).hex() not in text and "\\x00\\x01" not in text


def test_peer_id_round_trip() -> None:
    ident = Identity.generate()
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key
    with pytest.raises(ValueError, match="not an Ed25519"):
        public_key_from_peer_id(
            "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
        )  # an RSA-style sha256 ID
    with pytest.raises(ValueError, match="base58"):
        public_key_from_peer_id("12D3KooW0OIl")


def test_base58_round_trip() -> None:
    for data in (b"", b"\0", b"\0\0abc", bytes(range(40))):
        if data:
            assert b58decode(b58encode(data)) == data
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"
