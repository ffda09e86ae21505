"""The invite's optional ``draft``: signed with the rest, absent from older invites."""

from __future__ import annotations

import json

import pytest

from swarm.manifest.manifest import parse_manifest, verify_manifest
from swarm.manifest.schema import ManifestInvalid, ModelSpec

from .fixtures import ISSUER, MODEL, NOW, make

DRAFT = ModelSpec("Qwen2.5-0.5B-Instruct", "ab" * 32, {"config.json": "ab" * 32, "model.safetensors": "cd" * 32})


def test_a_draft_is_signed_and_read_back() -> None:
    m = make(model=MODEL, draft=DRAFT)
    back = parse_manifest(m.to_json_bytes())
    verify_manifest(back, now=NOW, expected_issuer=ISSUER.public_key)
    assert back.draft == DRAFT and back.public_dict()["draft"]["name"] == DRAFT.name
    obj = json.loads(m.to_json_bytes())
    obj["draft"]["files"]["model.safetensors"] = "ee" * 32  # another draft: the signature breaks
    with pytest.raises(ManifestInvalid, match="signature"):
        verify_manifest(parse_manifest(json.dumps(obj).encode()), now=NOW)


def test_an_invite_without_a_draft_keeps_its_bytes() -> None:
    m = make(model=MODEL)
    assert "draft" not in json.loads(m.to_json_bytes()) and parse_manifest(m.to_json_bytes()).draft is None


@pytest.mark.parametrize(
    ("draft", "field"),
    [
        (None, "draft"),
        ({"name": "x", "config_sha256": None}, "draft.files"),
        ({"name": "x", "config_sha256": None, "files": {"../w": "ab" * 32}}, "draft.files"),
        ({"name": "x", "config_sha256": "nothex", "files": {"w": "ab" * 32}}, "draft.config_sha256"),
    ],
)
def test_a_malformed_draft_is_refused_naming_the_field(draft: object, field: str) -> None:
    obj = json.loads(make(model=MODEL).to_json_bytes())
    obj["draft"] = draft
    with pytest.raises(ManifestInvalid) as info:
        parse_manifest(json.dumps(obj).encode())
    assert info.value.field == field
