"""GGUF kept compact: Q4_0 / Q4_1 / Q4_K blocks repacked into int4 equal gguf's own dequantization,
Q8_0 loads as int8 within half a per-row step, and a type we cannot keep compact is refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swarm.errors import WeightsError
from swarm.model.bundled import bundled_gguf_path
from swarm.model.gguf_quant import repack_int4
from swarm.model.quant import Int4Groups, QuantLinear
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint

D, H, KV, F, L = 256, 4, 2, 256, 2  # K-quants need rows of 256


def _raw_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but valid blocks: f16 scales set to small positive numbers, the rest random bits."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = {Q.Q4_K: (0, 2), Q.IQ4_NL: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2)}[qtype]
    for off in scales:
        b[..., off : off + 2] = (rng.uniform(0.001, 0.02, size=b.shape[:2]).astype(np.float16)
                                 .view(np.uint8).reshape(*b.shape[:2], 2))  # fmt: skip
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_repacked_blocks_equal_gguf_dequantization(qtype: Q) -> None:
    raw = _raw_blocks(qtype, 32, 512, seed=int(qtype))
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(32, 512)
    g = repack_int4(raw, qtype, (32, 512))
    assert g.group == 32 and g.q.dtype == torch.uint8
    torch.testing.assert_close(g.dequantize(), want, rtol=1e-6, atol=1e-7)
    m = QuantLinear.int4(g, None, torch.float32, torch.device("cpu"))
    assert m.kernel == "dequant"
    torch.testing.assert_close(m.dequantized(), want, rtol=1e-6, atol=1e-6)
    # the packed CPU kernel's (private) layout holds the same integers, with bf16 scales
    mb = QuantLinear.int4(g, None, torch.bfloat16, torch.device("cpu"))
    assert mb.kernel == "int4pack_cpu"
    bf = Int4Groups(g.q, g.scale.bfloat16().float(), g.zero.bfloat16().float(), 32)
    torch.testing.assert_close(mb.dequantized(), bf.dequantize(), rtol=1e-6, atol=1e-6)


def _write(path: Path, qtype: Q, embd: Q = Q.F32) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    for k, v in {"block_count": L, "context_length": 128, "embedding_length": D, "feed_forward_length": F,
                 "attention.head_count": H, "attention.head_count_kv": KV}.items():  # fmt: skip
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    rng = np.random.default_rng(0)
    embedding = (rng.standard_normal((32, D)) * 0.1).astype(np.float32)
    if embd == Q.F32:
        w.add_tensor("token_embd.weight", embedding)
    else:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, embd), raw_dtype=embd)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    hd = D // H
    shapes = {"attn_q": (H * hd, D), "attn_k": (KV * hd, D), "attn_v": (KV * hd, D), "attn_output": (D, H * hd),
              "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}  # fmt: skip
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, np.float32))
        for j, (name, (n, k)) in enumerate(shapes.items()):
            if qtype == Q.Q8_0:
                raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
            else:
                raw = _raw_blocks(qtype, n, k, seed=100 * i + j)
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _linears(stage: Stage) -> dict[str, QuantLinear]:
    return {f"model.layers.{stage.start + i}.{n}.weight": m for i, layer in enumerate(stage.layers)
            for n, m in layer.named_modules() if isinstance(m, QuantLinear)}  # fmt: skip


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K])
def test_q4_files_load_compact_and_equal_gguf(tmp_path: Path, qtype: Q) -> None:
    ck = open_checkpoint(_write(tmp_path / "m.gguf", qtype))
    stage = Stage.load(ck.args, ck.source, 0, L, dtype=torch.float32, quant="int4")
    got = _linears(stage)
    assert len(got) == 7 * L
    for name, m in got.items():
        assert m.group == 32 and m.kernel == "dequant", name  # fp32 activations: see quant.py
        # the float path dequantizes with gguf (and undoes llama.cpp's Q/K row permutation)
        want = ck.source.load(name, torch.float32)
        torch.testing.assert_close(m.dequantized(), want, rtol=1e-6, atol=1e-6, msg=name)


def test_q8_0_loads_as_int8_within_half_a_row_step(tmp_path: Path) -> None:
    ck = open_checkpoint(_write(tmp_path / "m.gguf", Q.Q8_0))
    stage = Stage.load(ck.args, ck.source, 1, L, dtype=torch.float32, quant="int8")
    for name, m in _linears(stage).items():
        assert m.kind == "int8" and m.qweight.dtype == torch.int8, name
        want = ck.source.load(name, torch.float32)
        err = (m.dequantized() - want).abs().amax(1)
        assert torch.all(err <= m.scales / 2 * (1 + 1e-5)), name


def test_a_type_we_cannot_keep_compact_is_refused(tmp_path: Path) -> None:
    ck = open_checkpoint(_write(tmp_path / "m.gguf", Q.IQ4_NL))
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_q\.weight'? is stored as IQ4_NL.*cannot be kept compact as int4"):
        Stage.load(ck.args, ck.source, 0, 1, dtype=torch.float32, quant="int4")
    Stage.load(ck.args, ck.source, 0, 1, dtype=torch.float32)  # served dequantized as before


def test_bundled_q4_1_loads_compact_and_exact() -> None:
    ck = open_checkpoint(bundled_gguf_path())
    stage = Stage.load(ck.args, ck.source, 29, 30, dtype=torch.float32, quant="int4")
    for name, m in _linears(stage).items():
        assert ck.source.gguf_type(name) == "Q4_1"
        torch.testing.assert_close(m.dequantized(), ck.source.load(name, torch.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("qtype", "want"), [(Q.Q4_0, "int4"), (Q.Q4_K, "int4"), (Q.Q8_0, "int8")])
def test_stored_quant_names_the_format_that_keeps_the_files_layers(tmp_path: Path, qtype: Q, want: str) -> None:
    from swarm.model.packaged import stored_quant

    assert stored_quant(_write(tmp_path / "m.gguf", qtype)) == want


def test_the_bundled_model_is_stored_as_int4_and_a_float_directory_as_none(tmp_path: Path) -> None:
    from swarm.model.bundled import default_model_dir
    from swarm.model.packaged import stored_quant
    from swarm.testing.checkpoints import TinySpec, write_checkpoint

    assert stored_quant(bundled_gguf_path()) == "int4"  # Q4_1 throughout its layers
    assert stored_quant(default_model_dir()) == "int4"  # its converted directory: from that GGUF
    assert stored_quant(write_checkpoint(tmp_path, TinySpec(n_layers=1), seed=0)) == "none"


def test_stored_head_quant_names_the_tied_heads_format(tmp_path: Path) -> None:
    from swarm.model.bundled import default_model_dir
    from swarm.model.packaged import stored_head_quant
    from swarm.testing.checkpoints import TinySpec, write_checkpoint

    assert stored_head_quant(_write(tmp_path / "f32.gguf", Q.Q4_0)) == "none"  # no output.weight: tied, F32
    assert stored_head_quant(_write(tmp_path / "q8.gguf", Q.Q4_0, embd=Q.Q8_0)) == "int8"
    assert stored_head_quant(bundled_gguf_path()) == "int8"  # its token_embd is Q8_0
    assert stored_head_quant(default_model_dir()) == "int8"
    assert stored_head_quant(write_checkpoint(tmp_path / "dense", TinySpec(n_layers=1), seed=0)) == "none"
