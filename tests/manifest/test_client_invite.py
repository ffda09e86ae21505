"""Client invites: `invite create --from MEMBER --client` through the CLI entry point, the one-way
derivation of what they hold, and the bytes of invites made before clients existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.manifest.manifest import read_manifest, verify_manifest
from swarm.proto.admission import client_secret, member_key

from .fixtures import NOW, ROOT, SECRET, make_client


@pytest.fixture(autouse=True)
def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cfg = tmp_path / "cfg"
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(cfg))
    return cfg


def test_invite_create_client_derives_a_lesser_credential(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    member_path, client_path = tmp_path / "m.invite", tmp_path / "c.invite"
    assert main(["invite", "create", "--swarm", "lab", "--bootstrap", "/ip4/127.0.0.1/tcp/4001", "-o", str(member_path)]) == 0
    assert main(["invite", "create", "--from", str(member_path), "--client", "-o", str(client_path)]) == 0
    m, c = read_manifest(member_path), read_manifest(client_path)
    assert c.role == "client" and m.role == "member"
    assert c.swarm_id == m.swarm_id and c.bootstrap == m.bootstrap and c.issuer == m.issuer
    assert c.secret.value == client_secret(m.secret.value) and c.member_key == member_key(m.secret.value)
    raw = client_path.read_bytes()
    assert json.loads(m.to_json_bytes())["secret"].encode() not in raw  # the swarm secret is not in it
    capsys.readouterr()
    assert main(["invite", "show", str(client_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["role"] == "client" and "secret" not in shown
    # a client invite cannot make more invites, nor join, nor serve as a bootstrap
    assert main(["invite", "create", "--from", str(client_path), "-o", str(tmp_path / "x.invite")]) == 2
    assert main(["join", "--manifest", str(client_path), "--no-serve", "--exit-after", "1"]) == 2
    assert "client invite" in capsys.readouterr().err
    assert main(["invite", "create", "--swarm", "x", "--client", "-o", str(tmp_path / "y.invite")]) == 2


def test_invites_made_before_clients_keep_their_bytes_and_signatures() -> None:
    for name in ("minimal.json", "with-model.json", "with-revocation.json", "with-quant.json"):
        data = (ROOT / "examples" / name).read_bytes()
        assert b'"role"' not in data and b'"member_key"' not in data
        m = read_manifest(ROOT / "examples" / name, now=NOW)
        assert m.role == "member" and m.to_json_bytes() == data  # re-serialised byte for byte
    c = read_manifest(ROOT / "examples" / "client.json", now=NOW)
    verify_manifest(c, now=NOW)
    assert c.to_json_bytes() == make_client().to_json_bytes()
    assert c.secret.value == client_secret(SECRET.value)
