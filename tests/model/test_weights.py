"""Tensor sources and open_checkpoint: lazy reads, and a clear error for every kind of bad file."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from swarm.errors import ConfigError, ModelError, WeightsError
from swarm.model.stage import Head, Stage
from swarm.model.weights import SafetensorsSource, TensorSource, open_checkpoint
from swarm.testing.checkpoints import TinySpec, random_tensors, write_checkpoint

SPEC = TinySpec(family="llama", n_layers=3)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("single"), SPEC, seed=0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), SPEC, seed=0, shards=3)


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "ck"
    shutil.copytree(src, dst)
    return dst


def test_single_file_roundtrip(single: Path) -> None:
    ck = open_checkpoint(single)
    assert isinstance(ck.source, TensorSource)
    assert ck.config_sha256 == hashlib.sha256((single / "config.json").read_bytes()).hexdigest()
    ref = random_tensors(SPEC, 0)
    assert sorted(ck.source.names()) == sorted(ref)
    name = "model.layers.1.mlp.up_proj.weight"
    assert ck.source.shape(name) == tuple(ref[name].shape)
    t = ck.source.load(name, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16))
    assert torch.equal(ck.source.load(name, torch.float32, torch.device("cpu")), ref[name])


def test_sharded_equals_single(single: Path, sharded: Path) -> None:
    a, b = open_checkpoint(single).source, open_checkpoint(sharded).source
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert torch.equal(a.load(n, torch.float32), b.load(n, torch.float32)), n


def test_stage_reads_only_its_shard(sharded: Path, tmp_path: Path) -> None:
    """Corrupt every shard but the one holding layer 0's tensors: a stage of layer 0 still loads."""
    d = _copy(sharded, tmp_path)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    mine = {wm[n] for n in wm if n.startswith("model.layers.0.")}
    assert len(mine) == 1, "test layout: layer 0 should sit in one shard"
    others = sorted(set(wm.values()) - mine)
    for f in others:
        (d / f).write_bytes(b"\x00" * 3)
    ck = open_checkpoint(d)
    stage = Stage.load(ck.args, ck.source, 0, 1, dtype=torch.float32)
    assert stage.end == 1
    victim = next(n for n in wm if wm[n] == others[-1])
    with pytest.raises(WeightsError) as e:
        ck.source.load(victim, torch.float32)
    assert others[-1] in str(e.value) and victim in str(e.value)


def test_missing_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC, seed=0)
    tensors = random_tensors(SPEC, 0)
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    ck = open_checkpoint(d)
    Stage.load(ck.args, ck.source, 0, 2, dtype=torch.float32)  # other layers are fine
    with pytest.raises(WeightsError) as e:
        Stage.load(ck.args, ck.source, 1, 3, dtype=torch.float32)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.2.self_attn.k_proj.weight is missing" in msg


def test_missing_head_tensor(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", SPEC, seed=0)
    tensors = random_tensors(SPEC, 0)
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    ck = open_checkpoint(d)
    with pytest.raises(WeightsError, match=r"lm_head.weight is missing"):
        Head.load(ck.args, ck.source)


def test_truncated_file_names_file_and_tensor(single: Path, tmp_path: Path) -> None:
    d = _copy(single, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightsError) as e:
        open_checkpoint(d)
    msg = str(e.value)
    assert str(f) in msg and "truncated" in msg and "tensor model." in msg


def test_truncated_shard_names_shard_and_tensor(sharded: Path, tmp_path: Path) -> None:
    d = _copy(sharded, tmp_path)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = wm["model.norm.weight"]
    data = (d / shard).read_bytes()
    (d / shard).write_bytes(data[:-8])
    ck = open_checkpoint(d)  # the index opens; the shard is only read when needed
    with pytest.raises(WeightsError) as e:
        Head.load(ck.args, ck.source)
    assert shard in str(e.value) and "truncated: tensor" in str(e.value)


def test_tiny_file_shorter_than_header(tmp_path: Path, single: Path) -> None:
    d = _copy(single, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(WeightsError, match="shorter than the 8-byte header"):
        open_checkpoint(d)


@pytest.mark.parametrize("kind", ["json", "length"])
def test_corrupt_header_names_file(single: Path, tmp_path: Path, kind: str) -> None:
    d = _copy(single, tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    if kind == "json":
        (n,) = struct.unpack("<Q", data[:8])
        data[8 : 8 + 6] = b"{{{{{{"
    else:
        data[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as e:
        open_checkpoint(d)
    assert str(f) in str(e.value)
    assert ("header" in str(e.value)) or ("not a valid safetensors" in str(e.value))


def test_shape_disagreeing_with_config(single: Path, tmp_path: Path) -> None:
    d = _copy(single, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(d)
    with pytest.raises(WeightsError) as e:
        Stage.load(ck.args, ck.source, 1, 2, dtype=torch.float32)
    msg = str(e.value)
    assert "model.layers.1.mlp.gate_proj.weight" in msg and "[128, 64]" in msg and "[96, 64]" in msg


def test_index_errors(sharded: Path, tmp_path: Path) -> None:
    d = _copy(sharded, tmp_path)
    idx = d / "model.safetensors.index.json"
    good = json.loads(idx.read_text())
    idx.write_text("{broken")
    with pytest.raises(WeightsError, match="shard index"):
        open_checkpoint(d)
    idx.write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(WeightsError, match="weight_map"):
        open_checkpoint(d)
    bad = dict(good["weight_map"], **{"model.norm.weight": "../escape.safetensors"})
    idx.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(WeightsError, match="outside the model directory"):
        open_checkpoint(d)
    gone = dict(good["weight_map"], **{"model.norm.weight": "model-missing.safetensors"})
    idx.write_text(json.dumps({"weight_map": gone}))
    ck = open_checkpoint(d)
    with pytest.raises(WeightsError, match=r"model-missing.safetensors: shard file missing \(needed for tensor model.norm.weight\)"):
        ck.source.load("model.norm.weight", torch.float32)


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model directory"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json: not found"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="hidden_size"):
        open_checkpoint(tmp_path)
    write_checkpoint(tmp_path / "w", SPEC)
    (tmp_path / "w" / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsSource(tmp_path / "w")


def test_gguf_path_dispatches_to_gguf_module(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="GGUF file not found"):
        open_checkpoint(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelError) as e:  # raised by swarm.model.gguf, a ModelError subclass
        open_checkpoint(bad)
    assert "bad.gguf" in str(e.value)


def test_bundled_gguf_opens_like_its_converted_dir() -> None:
    bundled = pytest.importorskip("swarm.model.bundled")
    gguf_path = bundled.bundled_gguf_path()
    ck = open_checkpoint(gguf_path)
    conv = open_checkpoint(bundled.default_model_dir())
    assert ck.args.n_layers == conv.args.n_layers == 30
    assert (ck.args.dim, ck.args.n_heads, ck.args.n_kv_heads) == (576, 9, 3)
    assert ck.args.tie_word_embeddings
    name = "model.layers.5.self_attn.k_proj.weight"
    assert ck.source.shape(name) == conv.source.shape(name)
    stage = Stage.load(ck.args, ck.source, 29, 30, dtype=torch.float32)  # dequantizes one layer only
    assert stage.layers[0].self_attn.k_proj.weight.shape == (192, 576)


def _resident_mapped(file: Path) -> int | None:
    """Bytes of ``file`` mapped into this process and resident (/proc/self/smaps), None without it."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total, mine, target = 0, False, str(file.resolve())
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
            mine = len(head) == 6 and head[5].strip() == target
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_loaded_stage_leaves_no_checkpoint_page_resident(single: Path) -> None:
    """Tensors are read into our own buffers, never taken from a map (module doc): a map's touched
    pages would count in the node's VmHWM beside the block it built, and no budget counts them."""
    if _resident_mapped(single / "model.safetensors") is None:
        pytest.skip("no /proc/self/smaps here")
    ck = open_checkpoint(single)
    stage = Stage.load(ck.args, ck.source, 0, 3, dtype=torch.float32, quant="int8")
    Head.load(ck.args, ck.source, dtype=torch.float32)
    assert stage.end == 3
    assert _resident_mapped(single / "model.safetensors") == 0
    gguf_path = pytest.importorskip("swarm.model.bundled").bundled_gguf_path()
    g = open_checkpoint(gguf_path)
    Stage.load(g.args, g.source, 0, 2, dtype=torch.float32, quant="int4")  # int4 straight from Q4 blocks
    Stage.load(g.args, g.source, 2, 3, dtype=torch.float32)  # dequantized
    assert _resident_mapped(gguf_path) == 0


def test_a_file_cut_after_it_was_opened_names_the_tensor(single: Path, tmp_path: Path) -> None:
    d = _copy(single, tmp_path)
    ck = open_checkpoint(d)  # header read and checked while the file was whole
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    name = max(ck.source.names(), key=lambda n: ck.source._shards[f].where[n][2])  # type: ignore[attr-defined]
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor .*bytes short"):
        ck.source.load(name, torch.float32)
