"""The invite's optional ``kv_cache``: how every peer holds its KV cache, signed with the rest,
carried into each node's settings and into the planner's KV arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.cli.main import main
from swarm.manifest.manifest import new_manifest, parse_manifest, verify_manifest
from swarm.manifest.schema import KV_CACHES, ManifestInvalid
from swarm.model import kvcache
from swarm.model.config import ModelArgs
from swarm.node.settings import model_spec, settings_from_mapping
from swarm.testing.checkpoints import TinySpec, tiny_config

from .fixtures import ISSUER, MODEL, NOW, ROOT, make


def test_the_formats_are_the_caches_and_the_schemas() -> None:
    assert KV_CACHES == kvcache.KV_FORMATS
    assert json.loads((ROOT / "schema.json").read_text())["properties"]["kv_cache"]["enum"] == list(KV_CACHES[1:])


def test_a_kv_cache_is_signed_and_read_back() -> None:
    m = make(model=MODEL, kv_cache="int8")
    back = parse_manifest(m.to_json_bytes())
    verify_manifest(back, now=NOW, expected_issuer=ISSUER.public_key)
    assert back.kv_cache == "int8" and back.public_dict()["kv_cache"] == "int8"
    obj = json.loads(m.to_json_bytes())
    obj["kv_cache"] = "fp8"  # another format than the issuer signed: the signature breaks
    with pytest.raises(ManifestInvalid, match="signature"):
        verify_manifest(parse_manifest(json.dumps(obj).encode()), now=NOW)


def test_an_invite_without_it_keeps_its_bytes_and_means_auto() -> None:
    m = make(model=MODEL)
    assert "kv_cache" not in json.loads(m.to_json_bytes())
    assert parse_manifest(m.to_json_bytes()).kv_cache == "auto"


@pytest.mark.parametrize("bad", ["auto", "int4", "INT8", "", 8, None, True, ["int8"]])
def test_a_bad_kv_cache_is_refused_naming_the_field(bad: object) -> None:
    obj = json.loads(make(model=MODEL).to_json_bytes())
    obj["kv_cache"] = bad
    with pytest.raises(ManifestInvalid) as err:
        parse_manifest(json.dumps(obj).encode())
    assert err.value.field == "kv_cache" and "int8, fp8" in str(err.value)
    if bad != "auto":  # written out, auto is refused (absent means auto, so invites keep their bytes)
        with pytest.raises(ManifestInvalid):
            new_manifest(swarm_name="x", issuer=ISSUER.public_key, kv_cache=str(bad))


def test_node_settings_take_it_from_the_invite_only() -> None:
    m = make(model=MODEL, kv_cache="int8")
    s = settings_from_mapping({"dtype": "fp32", "device": "cpu", "model_dir": None}, seed=b"\0" * 32, manifest=m)
    assert s.kv_cache == "int8"
    with pytest.raises(Exception, match="kv_cache"):
        settings_from_mapping({"kv_cache": "fp8"}, seed=b"\0" * 32, manifest=m)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_planners_kv_bytes_follow_the_format(fmt: str) -> None:
    """A peer's KV per layer at the swarm's context shrinks to (head_dim + 2) / (2 head_dim) of
    bf16's, so the same memory holds more layers or a longer context."""
    args = ModelArgs.from_config(tiny_config(TinySpec(family="llama")))
    full = model_spec(args, torch.bfloat16, 8192)
    small = model_spec(args, torch.bfloat16, 8192, kv_cache=fmt)
    ratio = small.kv_bytes_per_token_per_layer / full.kv_bytes_per_token_per_layer
    assert ratio == (args.head_dim + 2) / (2 * args.head_dim)
    assert small.bytes_per_layer < full.bytes_per_layer and small.layer_bytes == full.layer_bytes


def test_invite_create_writes_it_and_refuses_a_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))
    out, again = tmp_path / "invite.json", tmp_path / "again.json"
    assert main(["invite", "create", "--swarm", "s", "--kv-cache", "int8", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["kv_cache"] == "int8"
    assert main(["invite", "create", "--from", str(out), "-o", str(again)]) == 0  # --from keeps it
    assert json.loads(again.read_text())["kv_cache"] == "int8"
    capsys.readouterr()
    assert main(["invite", "create", "--swarm", "s", "--kv-cache", "int4", "-o", str(tmp_path / "b.json")]) == 2
    assert "--kv-cache 'int4': choose one of auto, int8, fp8" in capsys.readouterr().err
