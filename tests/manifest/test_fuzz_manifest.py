"""Fuzz the manifest verifier with structurally plausible manifests: any field replaced by any
JSON value either still verifies (only if unchanged) or raises ManifestInvalid naming a reason."""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.manifest.manifest import parse_manifest, verify_manifest
from swarm.manifest.schema import ManifestInvalid

from .fixtures import MODEL, NOW, make

GOOD = json.loads(make(model=MODEL, bootstrap=("/ip4/1.2.3.4/tcp/1",)).to_json_bytes())
PATHS = [("version",), ("swarm",), ("swarm", "name"), ("swarm", "id"), ("model",), ("model", "name"),
         ("model", "config_sha256"), ("model", "files"), ("bootstrap",), ("secret",), ("issuer",),
         ("created",), ("expires",), ("revoked",), ("signature",), ("extra",)]  # fmt: skip
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=70),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
FUZZ = settings(
    max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(st.sampled_from(PATHS), json_value, st.booleans())
def test_any_field_any_value(path: tuple[str, ...], value: Any, delete: bool) -> None:
    obj = json.loads(json.dumps(GOOD))
    target = obj
    for key in path[:-1]:
        target = target[key]
    if delete:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    try:
        verify_manifest(parse_manifest(json.dumps(obj).encode()), now=NOW)
    except ManifestInvalid as exc:
        assert exc.reason.value in str(exc)
        return
    assert obj == GOOD or (delete and path == ("extra",)), "a changed manifest verified"
