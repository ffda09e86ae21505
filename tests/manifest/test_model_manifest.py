"""Model manifests: every tensor's file, byte range and sha256, from headers read as prefixes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from swarm.errors import WeightsError
from swarm.manifest.headers import NeedMore, parse_gguf, parse_safetensors
from swarm.manifest.model_manifest import (
    LocalFiles,
    manifest_of_path,
    parse_model_manifest,
    read_table,
)
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.gguf_files import write_family_gguf

SPEC = TinySpec(n_layers=4)


def _bytes_of(path: Path, a: int, b: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(a)
        return f.read(b - a)


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_manifest_ranges_are_the_tensors_bytes(tmp_path: Path, shards: int) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC, shards=shards)
    m = manifest_of_path(d)
    assert m.kind == "safetensors" and m.n_layers == 4
    weights = {f.path for f in m.weight_files()}
    assert weights == ({"model.safetensors"} if shards == 1 else {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)})
    assert "config.json" in m.files and not m.files["config.json"].is_weights
    if shards > 1:
        assert "model.safetensors.index.json" in m.files
    n = 0
    for path in weights:
        with safe_open(str(d / path), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 (not a dict)
                t = m.tensors[name]
                raw = h.get_tensor(name).numpy().tobytes()
                assert _bytes_of(d / path, t.start, t.end) == raw
                assert t.sha256 == hashlib.sha256(raw).hexdigest()
                n += 1
    assert n == len(m.tensors)
    assert m.tensors["model.layers.2.mlp.up_proj.weight"].layer == 2
    assert m.tensors["model.embed_tokens.weight"].layer is None
    block = {t.name for t in m.block(1, 3)}
    assert block and all(m.tensors[x].layer in (1, 2) for x in block)
    assert {t.name for t in m.head()} >= {"model.embed_tokens.weight", "model.norm.weight"}


def test_manifest_hash_is_canonical_and_round_trips(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC, shards=2)
    m = manifest_of_path(d, name="tiny")
    again = parse_model_manifest(json.dumps(m.to_json(), indent=2).encode())
    assert again == m and again.digest() == m.digest()
    assert m.digest() == hashlib.sha256(m.canonical_bytes()).hexdigest()
    other = manifest_of_path(write_checkpoint(tmp_path / "n", SPEC, seed=1, shards=2), name="tiny")
    assert other.digest() != m.digest()  # same names and ranges, other bytes


@pytest.mark.parametrize("split", [1, 3])
def test_gguf_manifest_single_and_split(tmp_path: Path, split: int) -> None:
    import gguf

    hf = write_checkpoint(tmp_path / "hf", SPEC)
    (tmp_path / "g").mkdir()
    first = write_family_gguf(hf, tmp_path / "g" / "tiny.gguf", split=split, qtype=gguf.GGMLQuantizationType.Q8_0)
    m = manifest_of_path(first)
    assert m.kind == "gguf" and len(m.weight_files()) == split and m.n_layers == 4
    reader = gguf.GGUFReader
    for f in m.weight_files():
        for rt in reader(str(first.parent / f.path)).tensors:
            t = m.tensors[rt.name]
            assert (t.start, t.end - t.start) == (int(rt.data_offset), int(rt.n_bytes)), rt.name
            assert t.sha256 == hashlib.sha256(_bytes_of(first.parent / f.path, t.start, t.end)).hexdigest()
    assert m.tensors["blk.3.attn_q.weight"].layer == 3 and m.tensors["blk.3.attn_q.weight"].dtype == "Q8_0"


def test_bundled_smollm2_gguf_manifest() -> None:
    from swarm.model.bundled import bundled_gguf_path

    p = bundled_gguf_path()
    m = manifest_of_path(p)
    assert m.n_layers == 30 and m.kind == "gguf"
    assert len(m.block(0, 10)) == 10 * len([t for t in m.tensors.values() if t.layer == 0])
    total = sum(t.nbytes for t in m.tensors.values()) + m.files[p.name].header_end
    assert total <= p.stat().st_size  # every byte is header, a tensor, or alignment padding
    assert p.stat().st_size - total < 32 * len(m.tensors)


def test_header_prefixes_ask_for_exactly_what_they_need(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC)
    raw = (d / "model.safetensors").read_bytes()
    with pytest.raises(NeedMore) as more:
        parse_safetensors(raw[:100], "x")
    table = parse_safetensors(raw[: more.value.size], "x")
    assert table.header_end == more.value.size
    calls: list[tuple[int, int]] = []

    class Counting(LocalFiles):
        def read(self, path: str, start: int, end: int) -> bytes:
            calls.append((start, end))
            return super().read(path, start, end)

    read_table(Counting(d), "model.safetensors", "safetensors", first=64)
    assert calls == [(0, 64), (0, table.header_end)]  # one short read, then the exact header
    with pytest.raises(NeedMore):
        parse_gguf(b"GGUF\x03\x00\x00\x00", "y")


def test_corrupt_or_truncated_headers_are_named(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(WeightsError, match="model.safetensors: truncated"):
        manifest_of_path(d)
    f.write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(WeightsError, match="implausible"):
        manifest_of_path(d)
    bad = json.loads(json.dumps(manifest_of_path(write_checkpoint(tmp_path / "n", SPEC)).to_json()))
    next(iter(bad["tensors"].values()))["sha256"] = "xyz"
    with pytest.raises(WeightsError, match="sha256"):
        parse_model_manifest(json.dumps(bad).encode())
