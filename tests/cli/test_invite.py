"""`shard-swarm invite create|verify|show` through the real CLI entry point (in process)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.manifest.identity import Identity, load_identity
from swarm.manifest.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2] / "manifests"


@pytest.fixture(autouse=True)
def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cfg = tmp_path / "cfg"
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(cfg))
    return cfg


def _create(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "lab.invite"
    args = [
        "invite",
        "create",
        "--swarm",
        "home lab",
        "--bootstrap",
        "/ip4/127.0.0.1/tcp/4001",
        "-o",
        str(out),
    ]
    assert main([*args, *extra]) == 0
    return out


def test_create_verify_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _create(tmp_path, "--expires", "12h")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    ident = load_identity(tmp_path / "cfg" / "identity.key")
    m = read_manifest(out)
    assert m.issuer == ident.public_key and m.expires - m.created == 12 * 3600
    assert m.bootstrap == ("/ip4/127.0.0.1/tcp/4001",) and m.model is None
    secret_b64 = json.loads(out.read_text())["secret"]
    capsys.readouterr()

    assert main(["invite", "verify", str(out)]) == 0
    assert main(["invite", "verify", "--json", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["valid"] is True and res["issuer_peer_id"] == ident.peer_id

    assert main(["invite", "show", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    shown = json.loads(captured.out)
    assert (
        shown["swarm"]["name"] == "home lab"
        and shown["status"] == "valid"
        and "secret" not in shown
    )
    assert main(["invite", "show", str(out)]) == 0
    captured2 = capsys.readouterr()
    for text in (captured.out, captured.err, captured2.out, captured2.err):
        assert secret_b64 not in text
    assert "(hidden)" in captured2.out and ident.peer_id in captured2.out


def test_tampered_invite_exits_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _create(tmp_path)
    obj = json.loads(out.read_text())
    obj["bootstrap"].append("/ip4/6.6.6.6/tcp/1")
    out.write_text(json.dumps(obj))
    capsys.readouterr()
    assert main(["invite", "verify", "--json", str(out)]) == 4
    cap = capsys.readouterr()
    assert json.loads(cap.out)["reason"] == "bad-signature"
    assert "(reason: bad-signature)" in cap.err and obj["secret"] not in cap.err
    # show still prints it, flagged
    assert main(["invite", "show", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "bad-signature"


@pytest.mark.parametrize(
    ("name", "reason"),
    [("expired.json", "expired"), ("unsigned.json", "unsigned"), ("not-json.json", "malformed"),
     ("oversized.json", "too-large"), ("unknown-version.json", "unknown-version"),
     ("not-yet-valid.json", "not-yet-valid")],
)  # fmt: skip
def test_broken_invites_exit_4(name: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["invite", "verify", str(ROOT / "broken" / name)]) == 4
    assert f"(reason: {reason})" in capsys.readouterr().err


def test_issuer_pinning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _create(tmp_path)
    me = load_identity(tmp_path / "cfg" / "identity.key").peer_id
    assert main(["invite", "verify", "--issuer", me, str(out)]) == 0
    other = "12D3KooWD527tGVJ6SFGnFEZsR4vuwx2u9xQwf1Dg6WoyHRS1Dgi"
    assert main(["invite", "verify", "--issuer", other, str(out)]) == 4
    assert "(reason: wrong-issuer)" in capsys.readouterr().err
    assert main(["invite", "verify", "--issuer", "nonsense", str(out)]) == 2


def test_model_pinning_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_bytes(b"abc")
    out = _create(tmp_path, "--model", str(model), "--model-name", "tiny")
    m = read_manifest(out)
    assert (
        m.model is not None
        and m.model.name == "tiny"
        and set(m.model.files) == {"config.json", "w.safetensors"}
    )
    assert main(["invite", "verify", "--model", str(model), str(out)]) == 0
    (model / "w.safetensors").write_bytes(b"abd")
    assert main(["invite", "verify", "--model", str(model), str(out)]) == 3
    assert "w.safetensors" in capsys.readouterr().err


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _create(tmp_path)
    assert main(["invite", "create", "--swarm", "x", "-o", str(out)]) == 2  # exists
    assert "--force" in capsys.readouterr().err
    assert (
        main(["invite", "create", "--swarm", "x", "-o", str(out), "--force", "--expires", "2d"])
        == 0
    )
    for bad in ("0d", "10", "5y", "-1h"):
        assert (
            main(["invite", "create", "--swarm", "x", "-o", str(tmp_path / "y"), "--expires", bad])
            == 2
        )
    assert main(["invite", "create", "--swarm", "../x", "-o", str(tmp_path / "z")]) == 4
    assert not (tmp_path / "z").exists()


def test_unprotected_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _create(tmp_path)
    os.chmod(tmp_path / "cfg" / "identity.key", 0o644)
    assert main(["invite", "create", "--swarm", "x", "-o", str(tmp_path / "b"), "--force"]) == 4
    assert "chmod 600" in capsys.readouterr().err


def test_reissue_keeps_swarm_and_secret_and_adds_revocations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _create(tmp_path)
    old = read_manifest(first)
    peer = "12D3KooWD527tGVJ6SFGnFEZsR4vuwx2u9xQwf1Dg6WoyHRS1Dgi"
    second = tmp_path / "v2.invite"
    assert (
        main(["invite", "create", "--from", str(first), "--revoke", peer, "-o", str(second)]) == 0
    )
    new = read_manifest(second)
    assert (new.swarm_id, new.swarm_name, new.secret, new.bootstrap) == (
        old.swarm_id, old.swarm_name, old.secret, old.bootstrap,
    )  # fmt: skip
    assert new.revoked == (peer,)
    third = tmp_path / "v3.invite"
    assert (
        main(["invite", "create", "--from", str(second), "--rotate-secret", "-o", str(third)]) == 0
    )
    rotated = read_manifest(third)
    assert (
        rotated.swarm_id == old.swarm_id
        and rotated.secret != old.secret
        and rotated.revoked == (peer,)
    )
    # someone else cannot re-issue it
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "other-cfg"))
    assert main(["invite", "create", "--from", str(first), "-o", str(tmp_path / "v4")]) == 4
    assert (
        main(["invite", "create", "--rotate-secret", "--swarm", "x", "-o", str(tmp_path / "v5")])
        == 2
    )
    assert main(["invite", "create", "-o", str(tmp_path / "v6")]) == 2


def test_quant_is_signed_into_the_invite_and_kept_on_reissue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = _create(tmp_path)
    assert "quant" not in json.loads(plain.read_text())  # none is never written: old invites keep their bytes
    assert read_manifest(plain).quant == "none"
    out = tmp_path / "q.invite"
    assert main(["invite", "create", "--swarm", "q lab", "--quant", "int4", "-o", str(out)]) == 0
    assert read_manifest(out).quant == "int4"
    capsys.readouterr()
    assert main(["invite", "show", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["quant"] == "int4"
    again = tmp_path / "q2.invite"
    assert main(["invite", "create", "--from", str(out), "-o", str(again)]) == 0
    assert read_manifest(again).quant == "int4"
    assert main(["invite", "create", "--swarm", "x", "--quant", "nf4", "-o", str(tmp_path / "bad")]) == 2
    assert "choose one of none, int8, int4" in capsys.readouterr().err


def test_show_prints_bootstrap_addresses_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peer = Identity.generate().peer_id
    addr = f"/ip4/198.51.100.2/tcp/4001/p2p/{peer}"
    out = tmp_path / "long.json"
    assert main(["invite", "create", "--swarm", "lab", "--bootstrap", addr, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["invite", "show", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"bootstrap: {addr}" in lines  # one line, whole: copyable into `join --peer`


@pytest.mark.parametrize("where", ["model.name", "key", "bootstrap"])
def test_a_lone_surrogate_anywhere_is_a_one_line_refusal_not_a_traceback(tmp_path: Path, where: str) -> None:
    """Issue 27: a crafted invite (\\ud800 in the model's name) crashed `invite verify`/`show`
    with a traceback (the signed bytes cannot encode it). Real CLI processes; exit 4 like every
    other malformed invite (module docstring of swarm/cli/invite.py)."""
    import subprocess
    import sys

    good = _create(tmp_path)
    obj = json.loads(good.read_text())
    if where == "model.name":
        obj["model"] = {"name": "m\ud800", "config_sha256": "0" * 64, "files": {"a.bin": "0" * 64}}
    elif where == "key":
        obj["x\udfff"] = 1
    else:
        obj["bootstrap"] = ["/ip4/1.2.3.4/tcp/1/p2p/\ud800"]
    bad = tmp_path / "crafted.json"
    bad.write_text(json.dumps(obj))  # ensure_ascii: the surrogate travels as a \ud800 escape
    bad.chmod(0o600)
    for cmd in ("verify", "show"):
        r = subprocess.run([sys.executable, "-m", "swarm.cli.main", "invite", cmd, str(bad)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 4, (cmd, r.returncode, r.stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr, r.stderr
