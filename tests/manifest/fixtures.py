"""Deterministic example and broken manifests for manifests/ (and the tests that load them).

Regenerate after a format change with ``.venv/bin/python tests/manifest/fixtures.py``;
``test_fixtures_on_disk_are_current`` fails if the files drift from this generator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest
from swarm.manifest.schema import Manifest, ModelSpec, SwarmSecret
from swarm.proto.admission import client_secret, member_key

ROOT = Path(__file__).resolve().parents[2] / "manifests"
ISSUER = Identity(hashlib.sha256(b"shard-swarm example issuer").digest())
OTHER = Identity(hashlib.sha256(b"shard-swarm other key").digest())
SECRET = SwarmSecret(hashlib.sha256(b"shard-swarm example secret (public! never use)").digest())
CREATED = 1_767_225_600  # 2026-01-01T00:00:00Z
FAR = 4_102_444_800 - CREATED  # until 2100-01-01
NOW = 1_780_000_000  # a "now" inside every example's validity


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


MODEL = ModelSpec(
    "SmolLM2-135M-Instruct",
    _digest("config.json"),
    {"config.json": _digest("config.json"), "model.safetensors": _digest("model.safetensors")},
)


def make(**kw: Any) -> Manifest:
    args: dict[str, Any] = dict(
        swarm_name="home lab", issuer=ISSUER.public_key, now=CREATED, lifetime_s=FAR,
        swarm_id="00112233445566778899aabbccddeeff", secret=SECRET,
    )  # fmt: skip
    args.update(kw)
    return sign_manifest(new_manifest(**args), ISSUER)


def _obj(m: Manifest) -> dict[str, Any]:
    return json.loads(m.to_json_bytes())


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def examples() -> dict[str, bytes]:
    return {
        "minimal.json": make().to_json_bytes(),
        "with-model.json": make(
            model=MODEL, bootstrap=("/ip4/203.0.113.7/tcp/4001/p2p/" + ISSUER.peer_id,)
        ).to_json_bytes(),
        "with-revocation.json": make(revoked=(OTHER.peer_id,)).to_json_bytes(),
        "with-quant.json": make(model=MODEL, quant="int4").to_json_bytes(),
        "client.json": make_client().to_json_bytes(),
    }


def make_client(**kw: Any) -> Manifest:
    """The client invite of the example swarm: the client secret and member key derived from SECRET."""
    return make(secret=SwarmSecret(client_secret(SECRET.value)), role="client", member_key=member_key(SECRET.value), **kw)


def broken() -> dict[str, tuple[bytes, str, str | None]]:
    """name -> (bytes, expected reason, expected field)."""
    good = _obj(make(model=MODEL))
    out: dict[str, tuple[bytes, str, str | None]] = {}

    def variant(name: str, reason: str, fld: str | None, change: Any) -> None:
        obj = json.loads(json.dumps(good))
        change(obj)
        out[name] = (_dump(obj), reason, fld)

    variant(
        "tampered-name.json",
        "bad-signature",
        "signature",
        lambda o: o["swarm"].update(name="evil lab"),
    )
    variant(
        "tampered-bootstrap.json",
        "bad-signature",
        "signature",
        lambda o: o["bootstrap"].append("/ip4/6.6.6.6/tcp/1"),
    )
    variant("tampered-file-hash.json", "bad-signature", "signature",
            lambda o: o["model"]["files"].update({"model.safetensors": _digest("evil")}))  # fmt: skip
    variant(
        "tampered-expiry.json",
        "bad-signature",
        "signature",
        lambda o: o.update(expires=o["expires"] + 1),
    )
    variant(
        "added-revoked.json",
        "bad-signature",
        "signature",
        lambda o: o.update(revoked=[OTHER.peer_id]),
    )
    variant(
        "swapped-issuer.json",
        "bad-signature",
        "signature",
        lambda o: o.update(issuer=_b64(OTHER.public_key)),
    )
    variant("unsigned.json", "unsigned", "signature", lambda o: o.pop("signature"))
    variant("null-signature.json", "unsigned", "signature", lambda o: o.update(signature=None))
    variant("missing-secret.json", "malformed", "secret", lambda o: o.pop("secret"))
    variant(
        "missing-model-files.json", "malformed", "model.files", lambda o: o["model"].pop("files")
    )
    variant("unknown-field.json", "malformed", "extra", lambda o: o.update(extra=1))
    variant("unknown-version.json", "unknown-version", "version", lambda o: o.update(version=2))
    variant("string-version.json", "unknown-version", "version", lambda o: o.update(version="1"))
    variant(
        "created-as-string.json", "malformed", "created", lambda o: o.update(created="2026-01-01")
    )
    variant("short-secret.json", "malformed", "secret", lambda o: o.update(secret=_b64(b"x" * 16)))
    variant(
        "bad-base64-issuer.json", "malformed", "issuer", lambda o: o.update(issuer="not base64!")
    )
    variant("bad-file-hash.json", "malformed", "model.files['config.json']",
            lambda o: o["model"]["files"].update({"config.json": "XYZ"}))  # fmt: skip
    variant(
        "path-escape.json",
        "malformed",
        "model.files",
        lambda o: o["model"]["files"].update({"../../etc/passwd": _digest("x")}),
    )
    variant(
        "bad-bootstrap.json",
        "malformed",
        "bootstrap[0]",
        lambda o: o.update(bootstrap=["tcp://1.2.3.4"]),
    )
    variant(
        "bad-revoked.json", "malformed", "revoked[0]", lambda o: o.update(revoked=["not-a-peer-id"])
    )
    variant(
        "expires-before-created.json",
        "malformed",
        "expires",
        lambda o: o.update(expires=o["created"]),
    )
    variant("bad-quant.json", "malformed", "quant", lambda o: o.update(quant="int3"))
    variant("none-quant.json", "malformed", "quant", lambda o: o.update(quant="none"))
    variant("tampered-quant.json", "bad-signature", "signature", lambda o: o.update(quant="int8"))
    variant("bad-swarm-id.json", "malformed", "swarm.id", lambda o: o["swarm"].update(id="xyz"))
    client = _obj(make_client())

    def client_variant(name: str, reason: str, fld: str | None, change: Any) -> None:
        obj = json.loads(json.dumps(client))
        change(obj)
        out[name] = (_dump(obj), reason, fld)

    client_variant("bad-role.json", "malformed", "role", lambda o: o.update(role="admin"))
    client_variant("client-without-member-key.json", "malformed", "member_key", lambda o: o.pop("member_key"))
    client_variant("member-key-without-role.json", "malformed", "member_key", lambda o: o.pop("role"))
    client_variant("short-member-key.json", "malformed", "member_key", lambda o: o.update(member_key=_b64(b"k" * 16)))
    client_variant("tampered-member-key.json", "bad-signature", "signature",
                   lambda o: o.update(member_key=_b64(OTHER.public_key)))  # fmt: skip
    out["not-json.json"] = (b'{"version": 1, "swarm": ', "malformed", None)
    out["not-an-object.json"] = (b"[1, 2, 3]\n", "malformed", None)
    out["float-time.json"] = (
        _dump(good).replace(b'"created": %d' % good["created"], b'"created": 1.5e9'),
        "malformed",
        None,
    )
    out["duplicate-key.json"] = (
        _dump(good).replace(b'"version": 1', b'"version": 1, "version": 1'),
        "malformed",
        None,
    )
    out["not-utf8.json"] = (b'{"version": 1, "swarm": {"name": "\xff\xfe"}}', "malformed", None)
    out["oversized.json"] = (_dump(good)[:-2] + b" " * (64 * 1024) + b"}\n", "too-large", None)
    out["expired.json"] = (make(now=CREATED, lifetime_s=3600).to_json_bytes(), "expired", "expires")
    # validly signed, but no date can be printed for it: `invite verify` once crashed on it
    far = sign_manifest(dataclasses.replace(make(), expires=1 << 61, signature=None), ISSUER)
    out["far-future-expiry.json"] = (far.to_json_bytes(), "malformed", "expires")
    out["not-yet-valid.json"] = (
        make(now=4_000_000_000, lifetime_s=86400).to_json_bytes(),
        "not-yet-valid",
        "created",
    )
    return out


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


def write_all() -> None:
    for name, data in examples().items():
        (ROOT / "examples" / name).write_bytes(data)
    expected = {}
    for name, (data, reason, fld) in broken().items():
        (ROOT / "broken" / name).write_bytes(data)
        expected[name] = {"reason": reason, "field": fld}
    (ROOT / "broken" / "EXPECTED.json").write_bytes(_dump(expected))


if __name__ == "__main__":
    write_all()
    print(f"wrote fixtures under {ROOT}", file=sys.stderr)
