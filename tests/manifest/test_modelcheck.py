"""Hashing a model for an invite and checking a local copy against it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from swarm.errors import ConfigError, WeightsError
from swarm.manifest.modelcheck import check_model, describe_model


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(b"w" * 3000)
    (d / "sub" / "tokenizer.json").write_text("{}")
    (d / ".cache").mkdir()
    (d / ".cache" / "junk").write_text("ignored")
    return d


def test_describe_directory(tmp_path: Path) -> None:
    d = _model(tmp_path)
    seen: list[tuple[int, int]] = []
    spec = describe_model(d, progress=lambda done, total: seen.append((done, total)))
    assert spec.name == "tiny-model"
    assert set(spec.files) == {"config.json", "model.safetensors", "sub/tokenizer.json"}
    assert spec.files["model.safetensors"] == hashlib.sha256(b"w" * 3000).hexdigest()
    assert spec.config_sha256 == spec.files["config.json"]
    assert seen[-1][0] == seen[-1][1] == 3000 + len('{"hidden_size": 8}') + 2
    check_model(spec, d)


def test_describe_single_file(tmp_path: Path) -> None:
    f = tmp_path / "smol.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    spec = describe_model(f, name="SmolLM2")
    assert (
        spec.name == "SmolLM2" and spec.config_sha256 is None and list(spec.files) == ["smol.gguf"]
    )
    check_model(spec, f)
    check_model(spec, tmp_path)


def test_mismatches_name_the_file(tmp_path: Path) -> None:
    d = _model(tmp_path)
    spec = describe_model(d)
    (d / "model.safetensors").write_bytes(b"w" * 2999 + b"x")
    with pytest.raises(WeightsError, match="model file model.safetensors .* re-download"):
        check_model(spec, d)
    (d / "model.safetensors").write_bytes(b"w" * 3000)
    (d / "config.json").write_text('{"hidden_size": 9}')
    with pytest.raises(ConfigError, match="config_sha256"):
        check_model(spec, d)
    (d / "sub" / "tokenizer.json").unlink()
    with pytest.raises(WeightsError, match="sub/tokenizer.json is missing"):
        check_model(spec, d)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="neither a file nor a directory"):
        describe_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds no files"):
        describe_model(tmp_path / "empty")
