"""A user's own copy checked tensor by tensor in place, only what a plan loads, each once; and
the CLI that makes a model manifest and an invite naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.errors import WeightsError
from swarm.fetch.cache import ModelCache
from swarm.fetch.slices import verify_block_in_place, verify_head_in_place
from swarm.manifest.manifest import read_manifest
from swarm.manifest.model_manifest import manifest_of_path, parse_model_manifest
from swarm.testing.checkpoints import TinySpec, write_checkpoint

SPEC = TinySpec(n_layers=4)


def test_a_flipped_byte_is_refused_while_the_other_layers_load(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC, shards=2)
    m = manifest_of_path(d)
    cache = ModelCache(tmp_path / "cache", m)
    bad = m.tensors["model.layers.2.self_attn.k_proj.weight"]
    with open(d / bad.file, "r+b") as f:
        f.seek(bad.start + 3)
        b = f.read(1)
        f.seek(bad.start + 3)
        f.write(bytes([b[0] ^ 0x80]))
    first = verify_block_in_place(cache, d, 0, 2)
    assert first >= m.block_bytes(0, 2)
    assert verify_block_in_place(cache, d, 0, 2) == 0  # remembered: nothing hashed twice
    with pytest.raises(WeightsError, match=rf"{bad.file}: tensor {bad.name}"):
        verify_block_in_place(cache, d, 2, 4)
    assert verify_head_in_place(cache, d) > 0
    # only layers [2, 4) and the header of the file they are in were hashed by the refusal: the
    # memo still holds layers 0-1, so a re-plan onto [1, 3) hashes layer 2 again, not layer 1
    with pytest.raises(WeightsError, match="k_proj"):
        verify_block_in_place(cache, d, 1, 3)
    os.utime(d / bad.file, ns=(1, 1))  # a changed file is hashed again
    with pytest.raises(WeightsError):
        verify_block_in_place(cache, d, 2, 3)


def test_model_manifest_cli_and_an_invite_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))
    d = write_checkpoint(tmp_path / "m", SPEC, shards=2)
    out = tmp_path / "tiny.manifest.json"
    assert main(["model", "manifest", str(d), "-o", str(out), "--name", "tiny"]) == 0
    m = parse_model_manifest(out.read_bytes())
    assert m == manifest_of_path(d, name="tiny")
    inv = tmp_path / "invite.json"
    assert main(["invite", "create", "--swarm", "lab", "--model-manifest", str(out), "--origin",
                 "https://huggingface.co/org/tiny/resolve/main", "--manifest-url", "https://example.org/tiny.json",
                 "-o", str(inv)]) == 0  # fmt: skip
    spec = read_manifest(inv).model
    assert spec is not None and spec.manifest_sha256 == m.digest() and spec.files == {}
    assert spec.origin == ("https://huggingface.co/org/tiny/resolve/main",)
    assert spec.config_sha256 == m.files["config.json"].sha256
    body = json.loads(inv.read_text())
    assert body["model"]["manifest_url"] == "https://example.org/tiny.json"
    assert main(["invite", "create", "--swarm", "lab", "--model-manifest", str(out), "--origin", "ftp://x",
                 "-o", str(tmp_path / "bad.json")]) == 2  # fmt: skip
