"""Trust on first use for invite issuers (issue 14): a look-alike invite for a swarm this
machine already joined, validly self-signed by another key, is refused by `join` (exit 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.manifest.pins import check_pin, pinned_issuer, pins_path
from swarm.manifest.schema import ManifestInvalid, Reason


@pytest.fixture(autouse=True)
def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))
    return tmp_path / "cfg"


def _invite(tmp_path: Path, name: str, issuer: Identity, swarm_id: str) -> Path:
    m = sign_manifest(
        new_manifest(swarm_name="home lab", issuer=issuer.public_key, bootstrap=["/ip4/127.0.0.1/tcp/9"], swarm_id=swarm_id),
        issuer,
    )
    path = tmp_path / name
    write_manifest(m, path)
    return path


def test_first_use_pins_and_a_look_alike_is_refused(tmp_path: Path) -> None:
    from swarm.manifest.manifest import read_manifest

    friend, stranger = Identity.generate(), Identity.generate()
    sid = "ab" * 16
    real = read_manifest(_invite(tmp_path, "real.json", friend, sid))
    fake = read_manifest(_invite(tmp_path, "fake.json", stranger, sid))
    assert pinned_issuer(real) is None
    assert check_pin(real) is True and check_pin(real) is False
    assert pinned_issuer(fake) == friend.peer_id
    with pytest.raises(ManifestInvalid) as err:
        check_pin(fake)
    assert err.value.reason is Reason.WRONG_ISSUER and friend.peer_id in str(err.value)
    assert check_pin(fake, replace=True) is True and pinned_issuer(real) == stranger.peer_id
    assert oct(pins_path().stat().st_mode & 0o777) == "0o600"


def test_join_refuses_a_look_alike_invite_and_show_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    friend, stranger = Identity.generate(), Identity.generate()
    sid = "cd" * 16
    real, fake = _invite(tmp_path, "real.json", friend, sid), _invite(tmp_path, "fake.json", stranger, sid)
    assert main(["invite", "pin", str(real)]) == 0
    assert main(["join", "--manifest", str(fake)]) == 4  # before any network or model work
    assert "was first joined on this machine" in capsys.readouterr().err
    assert main(["invite", "show", "--json", str(fake)]) == 0
    assert json.loads(capsys.readouterr().out)["issuer_pin"] == "mismatch"
    assert main(["invite", "show", "--json", str(real)]) == 0
    assert json.loads(capsys.readouterr().out)["issuer_pin"] == "match"
