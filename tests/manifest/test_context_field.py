"""The invite's optional ``context``: the swarm's context in tokens, signed with the rest."""

from __future__ import annotations

import json

import pytest

from swarm.manifest.manifest import parse_manifest, verify_manifest
from swarm.manifest.schema import DEFAULT_CONTEXT, ManifestInvalid
from swarm.node.settings import settings_from_mapping

from .fixtures import ISSUER, MODEL, NOW, make


def test_a_context_is_signed_and_read_back() -> None:
    m = make(model=MODEL, context=32768)
    back = parse_manifest(m.to_json_bytes())
    verify_manifest(back, now=NOW, expected_issuer=ISSUER.public_key)
    assert back.context_tokens == 32768 and back.public_dict()["context"] == 32768
    obj = json.loads(m.to_json_bytes())
    obj["context"] = 65536  # a longer context than the issuer signed: the signature breaks
    with pytest.raises(ManifestInvalid, match="signature"):
        verify_manifest(parse_manifest(json.dumps(obj).encode()), now=NOW)


def test_an_invite_without_a_context_keeps_its_bytes_and_gets_the_default() -> None:
    m = make(model=MODEL)
    assert "context" not in json.loads(m.to_json_bytes())
    assert parse_manifest(m.to_json_bytes()).context_tokens == DEFAULT_CONTEXT >= 8192


@pytest.mark.parametrize("bad", [0, 63, 1 << 21, "8192", True, None])
def test_a_bad_context_is_refused_naming_the_field(bad: object) -> None:
    obj = json.loads(make(model=MODEL).to_json_bytes())
    obj["context"] = bad
    with pytest.raises(ManifestInvalid) as err:
        parse_manifest(json.dumps(obj).encode())
    assert err.value.field == "context"


def test_node_settings_take_the_context_from_the_invite_only() -> None:
    m = make(model=MODEL, context=4096)
    s = settings_from_mapping({"dtype": "fp32", "device": "cpu", "model_dir": None}, seed=b"\0" * 32, manifest=m)
    assert s.context_tokens == 4096
    with pytest.raises(Exception, match="context_tokens"):
        settings_from_mapping({"context_tokens": 1024}, seed=b"\0" * 32, manifest=m)
