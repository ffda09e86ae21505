"""A node's settings file (node/settings.py ``settings_from_file``, what ``python -m swarm.node``
and the local process swarms start from): every key by its field name, values coerced to the
field's type, the invite's fields from the verified invite only, secrets from 0600 files; an
unknown or invite-only key, or an invite whose signature breaks, is refused before anything runs.
(The invite's context and KV format: tests/manifest/test_context_field.py, test_kv_cache_field.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import UsageError
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.manifest.schema import ManifestInvalid
from swarm.node.settings import NodeSettings, settings_from_file

ISSUER = Identity.generate()
REVOKED = Identity.generate().peer_id
SEED = bytes(range(32))


def _files(tmp_path: Path, cfg: dict[str, Any], *, tamper: bool = False) -> Path:
    m = sign_manifest(new_manifest(swarm_name="friends", issuer=ISSUER.public_key, bootstrap=("/ip4/10.0.0.1/tcp/4001/p2p/x",),
                                   revoked=(REVOKED,), context=4096), ISSUER)  # fmt: skip
    invite = tmp_path / "invite.json"
    write_manifest(m, invite)
    if tamper:
        obj = json.loads(invite.read_text())
        obj["bootstrap"] = ["/ip4/6.6.6.6/tcp/4001/p2p/evil"]  # a bootstrap the issuer never signed
        invite.write_text(json.dumps(obj))
    seed = tmp_path / "seed.hex"
    seed.write_text(SEED.hex() + "\n")
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"manifest": str(invite), "seed_file": str(seed), **cfg}))
    return path


def test_a_settings_file_gives_every_field_its_type_and_the_invites_fields(tmp_path: Path) -> None:
    cfg = {"device": "cpu", "dtype": "fp32", "model_dir": str(tmp_path / "model"), "listen": ["/ip4/127.0.0.1/tcp/0"],
           "memory_bytes": 3_000_000_000, "chunk_timeout": 7, "mdns": 1, "threads": 2, "draft": "none"}  # fmt: skip
    s = settings_from_file(_files(tmp_path, cfg))
    assert s.seed == SEED and s.model_dir == tmp_path / "model"
    assert s.listen == ("/ip4/127.0.0.1/tcp/0",) and s.memory_bytes == 3_000_000_000 and s.threads == 2
    assert s.chunk_timeout == 7.0 and isinstance(s.chunk_timeout, float)
    assert s.mdns is True and s.dtype is torch.float32 and s.device == "cpu" and s.draft == "none"
    assert s.bootstrap == ("/ip4/10.0.0.1/tcp/4001/p2p/x",) and s.revoked == frozenset({REVOKED})
    assert s.context_tokens == 4096 and len(s.secret) == 32 and s.swarm_id
    assert s.settle_s == NodeSettings.settle_s and s.fastpath is NodeSettings.fastpath  # absent: the dataclass's


@pytest.mark.parametrize("key", ["secret", "bootstrap", "context_tokens", "quant", "no_such_field"])
def test_an_unknown_or_invite_only_key_is_refused_by_name(tmp_path: Path, key: str) -> None:
    with pytest.raises(UsageError, match=f"unknown or invite-only key '{key}'"):
        settings_from_file(_files(tmp_path, {"device": "cpu", key: 1}))


def test_an_invite_whose_signature_breaks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestInvalid, match="signature"):
        settings_from_file(_files(tmp_path, {"device": "cpu"}, tamper=True))
