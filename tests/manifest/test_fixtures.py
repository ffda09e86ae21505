"""manifests/examples verify; every manifests/broken file is refused for its documented reason."""

from __future__ import annotations

import json

import pytest

from swarm.manifest.manifest import parse_manifest, verify_manifest
from swarm.manifest.schema import FIELDS, ManifestInvalid

from .fixtures import NOW, ROOT, broken, examples

EXPECTED = json.loads((ROOT / "broken" / "EXPECTED.json").read_text())


@pytest.mark.parametrize("name", sorted(examples()))
def test_examples_verify(name: str) -> None:
    verify_manifest(parse_manifest((ROOT / "examples" / name).read_bytes()), now=NOW)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_is_refused_for_its_reason(name: str) -> None:
    data = (ROOT / "broken" / name).read_bytes()
    with pytest.raises(ManifestInvalid) as info:
        verify_manifest(parse_manifest(data, where=name), now=NOW, where=name)
    want = EXPECTED[name]
    assert info.value.reason.value == want["reason"], str(info.value)
    if want["field"] is not None:
        assert info.value.field == want["field"], str(info.value)
        assert f"field '{want['field']}'" in str(info.value)
    assert name in str(info.value)


def test_every_broken_file_is_listed() -> None:
    on_disk = {p.name for p in (ROOT / "broken").iterdir()} - {"EXPECTED.json"}
    assert on_disk == set(EXPECTED) and len(on_disk) >= 25


def test_fixtures_on_disk_are_current() -> None:
    for name, data in examples().items():
        assert (ROOT / "examples" / name).read_bytes() == data, f"regenerate: {name}"
    for name, (data, reason, fld) in broken().items():
        assert (ROOT / "broken" / name).read_bytes() == data, f"regenerate: {name}"
        assert EXPECTED[name] == {"reason": reason, "field": fld}


def test_quant_names_agree_with_the_runtime() -> None:
    from swarm.manifest.schema import QUANTS
    from swarm.model import quant

    assert QUANTS == quant.QUANTS
    assert json.loads((ROOT / "schema.json").read_text())["properties"]["quant"]["enum"] == list(QUANTS[1:])


def test_schema_names_the_same_fields() -> None:
    schema = json.loads((ROOT / "schema.json").read_text())
    assert set(schema["properties"]) == FIELDS
    assert set(schema["required"]) == FIELDS - {"revoked", "quant", "context", "kv_cache", "draft", "role", "member_key", "signature"}
    assert schema["additionalProperties"] is False
