"""Manifests: canonical bytes, signing, each class of refusal, and the secret never shown."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest

from swarm.errors import ManifestError
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import (
    new_manifest,
    parse_manifest,
    read_manifest,
    sign_manifest,
    verify_manifest,
    write_manifest,
)
from swarm.manifest.schema import (
    MAX_MANIFEST_BYTES,
    ManifestInvalid,
    Reason,
    SwarmSecret,
    canonical_bytes,
)

from .fixtures import CREATED, ISSUER, MODEL, NOW, OTHER, SECRET, make


def _refused(
    data: bytes, reason: Reason, field: str | None = None, **kw: object
) -> ManifestInvalid:
    with pytest.raises(ManifestInvalid) as info:
        verify_manifest(parse_manifest(data), **kw)  # type: ignore[arg-type]
    assert info.value.reason is reason, str(info.value)
    if field is not None:
        assert info.value.field == field and f"'{field}'" in str(info.value)
    assert f"(reason: {reason.value})" in str(info.value)
    assert isinstance(info.value, ManifestError) and info.value.exit_code == 4
    return info.value


def test_canonical_bytes() -> None:
    assert (
        canonical_bytes({"b": [1, {"z": None, "a": "é"}], "a": True})
        == '{"a":true,"b":[1,{"a":"é","z":null}]}'.encode()
    )
    with pytest.raises(ManifestInvalid, match="floats"):
        canonical_bytes({"a": 0.5})


def test_sign_parse_verify_round_trip() -> None:
    m = make(model=MODEL, bootstrap=("/ip4/1.2.3.4/tcp/1",), revoked=(OTHER.peer_id,))
    back = parse_manifest(m.to_json_bytes())
    verify_manifest(back, now=NOW, expected_issuer=ISSUER.public_key)
    assert back.model == MODEL and back.revoked == (OTHER.peer_id,) and back.secret == SECRET
    assert back.issuer_peer_id == ISSUER.peer_id and back.swarm_id == m.swarm_id


def test_reindented_file_still_verifies() -> None:
    m = make()
    obj = json.loads(m.to_json_bytes())
    compact = json.dumps(obj, separators=(",", ":")).encode()
    verify_manifest(parse_manifest(compact), now=NOW)
    reordered = json.dumps(dict(reversed(list(obj.items()))), indent=7).encode()
    verify_manifest(parse_manifest(reordered), now=NOW)


@pytest.mark.parametrize(
    "path",
    [("swarm", "name"), ("swarm", "id"), ("bootstrap",), ("secret",), ("created",), ("expires",), ("model", "name"),
     ("model", "config_sha256"), ("model", "files")],
)  # fmt: skip
def test_tampering_with_any_field_breaks_the_signature(path: tuple[str, ...]) -> None:
    obj = json.loads(make(model=MODEL, bootstrap=("/ip4/1.2.3.4/tcp/1",)).to_json_bytes())
    target = obj
    for key in path[:-1]:
        target = target[key]
    old = target[path[-1]]
    new = {
        str: lambda v: "00" * 32 if len(v) == 64 else ("ab" * 16 if len(v) == 32 else v[:-1] + "X"),
        int: lambda v: v + 1,
        list: lambda v: [*v, "/ip4/6.6.6.6/tcp/6"],
        dict: lambda v: {**v, "extra.bin": "11" * 32},
    }[type(old)](old)
    if path == ("secret",):
        new = SwarmSecret(b"z" * 32)
        new = __import__("base64").b64encode(new.value).decode()
    target[path[-1]] = new
    _refused(json.dumps(obj).encode(), Reason.BAD_SIGNATURE, "signature", now=NOW)


def test_unsigned_wrong_key_wrong_issuer() -> None:
    unsigned = new_manifest(swarm_name="x", issuer=ISSUER.public_key, now=CREATED)
    _refused(unsigned.to_json_bytes(), Reason.UNSIGNED, "signature", now=CREATED)
    # signed by OTHER but naming ISSUER as issuer
    forged = dataclasses.replace(unsigned, signature=OTHER.sign(unsigned.signed_bytes()))
    _refused(forged.to_json_bytes(), Reason.BAD_SIGNATURE, "signature", now=CREATED)
    # valid, but not the issuer we trust
    err = _refused(
        make().to_json_bytes(),
        Reason.WRONG_ISSUER,
        "issuer",
        now=NOW,
        expected_issuer=OTHER.public_key,
    )
    assert OTHER.peer_id in str(err) and ISSUER.peer_id in str(err)
    with pytest.raises(ManifestInvalid, match="not the manifest's issuer"):
        sign_manifest(unsigned, OTHER)


def test_time_window() -> None:
    m = make(now=1000, lifetime_s=100).to_json_bytes()
    verify_manifest(parse_manifest(m), now=1000)
    verify_manifest(parse_manifest(m), now=1099)
    _refused(m, Reason.EXPIRED, "expires", now=1100)
    verify_manifest(parse_manifest(m), now=1000 - 300)  # within clock skew
    _refused(m, Reason.NOT_YET_VALID, "created", now=1000 - 301)


def test_size_cap() -> None:
    good = make().to_json_bytes()
    padded = good[:-2] + b" " * (MAX_MANIFEST_BYTES - len(good)) + b"}\n"
    assert len(padded) == MAX_MANIFEST_BYTES
    verify_manifest(parse_manifest(padded), now=NOW)
    _refused(padded + b" ", Reason.TOO_LARGE)


def test_secret_never_shown() -> None:
    m = make(model=MODEL)
    secret_b64 = json.loads(m.to_json_bytes())["secret"]
    shown = repr(m) + str(m) + json.dumps(m.public_dict()) + repr(m.secret) + str(m.secret)
    assert secret_b64 not in shown and SECRET.value.hex() not in shown and "<hidden>" in shown
    assert "secret" not in m.public_dict()
    # nor in any refusal message
    obj = json.loads(m.to_json_bytes())
    obj["secret"] = secret_b64[:-4]
    err = _refused(json.dumps(obj).encode(), Reason.MALFORMED, "secret")
    assert secret_b64[:-4] not in str(err)


def test_write_is_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "x.invite"
    write_manifest(make(), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ManifestInvalid, match="expired"):
        read_manifest(path, now=4_102_444_800)
    assert read_manifest(path, now=NOW).swarm_name == "home lab"
    assert read_manifest(path, now=4_102_444_800, allow_expired=True).swarm_name == "home lab"
    with pytest.raises(ManifestInvalid, match="cannot read"):
        read_manifest(tmp_path / "missing")


def test_new_manifest_defaults_are_random_and_valid() -> None:
    a = sign_manifest(new_manifest(swarm_name="lab", issuer=ISSUER.public_key), ISSUER)
    b = sign_manifest(new_manifest(swarm_name="lab", issuer=ISSUER.public_key), ISSUER)
    assert a.swarm_id != b.swarm_id and a.secret != b.secret
    verify_manifest(parse_manifest(a.to_json_bytes()))
    with pytest.raises(ManifestInvalid, match="swarm.name"):
        new_manifest(swarm_name="../evil", issuer=ISSUER.public_key)
    with pytest.raises(ManifestInvalid, match="lifetime"):
        new_manifest(swarm_name="lab", issuer=ISSUER.public_key, lifetime_s=0)
    assert Identity(ISSUER.seed) == ISSUER


def test_a_world_readable_invite_is_read_with_a_warning(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging
    import os

    from swarm.manifest.identity import Identity
    from swarm.manifest.manifest import new_manifest, read_manifest, sign_manifest, write_manifest

    issuer = Identity(os.urandom(32))
    path = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="w", issuer=issuer.public_key), issuer), path)
    with caplog.at_level(logging.WARNING, logger="swarm.manifest"):
        read_manifest(path)
    assert "readable by other users" not in caplog.text  # written 0600
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="swarm.manifest"):
        m = read_manifest(path)
    assert m.swarm_name == "w" and "readable by other users" in caplog.text and "chmod 600" in caplog.text
    assert m.secret.value.hex() not in caplog.text
