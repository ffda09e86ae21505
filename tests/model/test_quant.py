"""Weight-only int8/int4: round trips with per-row/per-group error bounds, the packed kernels
against the weights they hold, any module (ours and transformers'), every split of a quantized
checkpoint against one process, token for token in fp32, and bad input."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from swarm.errors import ConfigError
from swarm.model.generate import LocalModel, generate
from swarm.model.quant import (
    QuantLinear,
    check_quant,
    int4_from_float,
    int4_group_for,
    int8_from_float,
    layer_bytes,
    linear_paths,
    quantize_block,
)
from swarm.model.stage import Stage
from swarm.testing.checkpoints import TinySpec, write_checkpoint

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17]


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] *= 20.0  # one loud row and one constant group: the scales must not be shared or zero
    w[5, :64] = 0.25
    return w


def test_int8_round_trip_is_within_half_a_step_per_row() -> None:
    w = _w(48, 96)
    q, s = int8_from_float(w, torch.float32)
    assert q.dtype == torch.int8 and s.shape == (48,)
    err = (q.float() * s[:, None] - w).abs().amax(1)
    assert torch.all(err <= s / 2 * (1 + 1e-5)), (err / s).max()
    assert int(q.abs().amax()) == 127  # the full range is used


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_per_group(group: int) -> None:
    w = _w(48, 256)
    g = int4_from_float(w, group, torch.float32)
    assert g.q.dtype == torch.uint8 and int(g.q.max()) <= 15 and g.scale.shape == (48, 256 // group)
    err = (g.dequantize() - w).abs().view(48, -1, group).amax(-1)
    assert torch.all(err <= g.scale / 2 * (1 + 1e-5) + 1e-7), (err / g.scale).max()
    assert float(err[5, 0]) == 0.0 or group > 64  # a constant group comes back exactly


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(64, 128), (40, 96)])  # 40 rows: int4 has no packed kernel there
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantlinear_multiplies_by_the_weights_it_holds(kind: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    n, k = shape
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_w(n, k, 1))
    w = lin.weight.detach().clone()
    m = quantize_block(nn.Sequential(lin).to(dtype), kind, group=32)[0]
    assert isinstance(m, QuantLinear)
    packed = dtype == torch.bfloat16 and (kind == "int8" or n % 16 == 0)
    assert m.kernel == ("dequant" if not packed else "int8pack" if kind == "int8" else "int4pack_cpu")
    x = torch.randn(2, 3, k)
    want = x @ m.dequantized().T + lin.bias.float()  # (2, 3, N)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(m(x.to(dtype)).float(), want, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        return  # the weight was rounded to bf16 before quantizing; the bound below is fp32's
    bound = 0.5 * (w.abs().amax(1, keepdim=True) / 127 if kind == "int8" else (w.max() - w.min()) / 15)
    assert float((m.dequantized() - w).abs().max()) <= float(bound.max()) * 1.001


def test_quantize_block_replaces_every_linear_of_a_transformers_layer() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32)  # fmt: skip
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).eval()
    x = torch.randn(1, 5, 64)
    pos = LlamaRotaryEmbedding(cfg)(x, torch.arange(5)[None])
    with torch.no_grad():
        want = layer(x, position_embeddings=pos)
        want = want[0] if isinstance(want, tuple) else want
        before = len(linear_paths(layer))
        quantize_block(layer, "int8")
        got = layer(x, position_embeddings=pos)
        got = got[0] if isinstance(got, tuple) else got
    assert before == 7 and linear_paths(layer) == []
    assert sum(isinstance(m, QuantLinear) for m in layer.modules()) == 7
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.02, rel


def test_bad_names_and_shapes_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown quantization 'int3'.*none, int8, int4"):
        check_quant("int3", "invite field 'quant'")
    with pytest.raises(ConfigError, match="unknown quantization"):
        quantize_block(nn.Linear(4, 4), "nf4")
    assert int4_group_for(576) == 32 and int4_group_for(576, 64) == 64 and int4_group_for(96, 64) == 32
    with pytest.raises(ConfigError, match="40 inputs"):
        int4_group_for(40)


def test_planner_bytes_match_the_resident_bytes(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=2), seed=1)
    st = {q: Stage.load(_args(ckpt), _source(ckpt), 0, 1, dtype=torch.bfloat16, quant=q) for q in ("none", "int8", "int4")}
    for q, stage in st.items():
        resident = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()]
                       if t.dim() > 0)  # fmt: skip
        assert resident == layer_bytes(_args(ckpt), q, 2), q
    assert layer_bytes(_args(ckpt), "int4", 2) < 0.35 * layer_bytes(_args(ckpt), "none", 2)


def _args(ckpt: Path):  # type: ignore[no-untyped-def]
    from swarm.model.weights import open_checkpoint

    return open_checkpoint(ckpt).args


def _source(ckpt: Path):  # type: ignore[no-untyped-def]
    from swarm.model.weights import open_checkpoint

    return open_checkpoint(ckpt).source


def _splits(n: int) -> list[list[tuple[int, int]]]:
    out = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        out.append(list(itertools.pairwise(bounds)))
    return out


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # dequant path, packed kernels
def test_every_split_of_a_quantized_checkpoint_equals_one_process(tmp_path: Path, quant: str, dtype: torch.dtype) -> None:
    """fp32 is exact on any CPU; bf16 (the packed kernels) compares this CPU with itself."""
    torch.set_num_threads(1)
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4, row_gain_spread=1.0), seed=3)
    one = LocalModel.load(ckpt, stages=1, dtype=dtype, quant=quant)
    q_proj = one.stages[0].layers[0].self_attn.q_proj
    assert q_proj.kernel == ("dequant" if dtype == torch.float32 else f"{quant}pack" + ("_cpu" if quant == "int4" else ""))
    assert all(isinstance(one.stages[0].layers[0].get_submodule(p), QuantLinear)
               for p in ("self_attn.q_proj", "mlp.down_proj"))  # fmt: skip
    want = generate(one, PROMPT, max_new_tokens=24, eos_token_ids=()).output_token_ids
    plain = generate(LocalModel.load(ckpt, stages=1, dtype=dtype), PROMPT, max_new_tokens=24,
                     eos_token_ids=()).output_token_ids  # fmt: skip
    if quant == "int4" and dtype == torch.float32:
        assert want != plain  # the quantization really changed the model (so the splits test it)
    for blocks in _splits(4):
        model = LocalModel.load(ckpt, stages=blocks, dtype=dtype, quant=quant)
        got = generate(model, PROMPT, max_new_tokens=24, eos_token_ids=()).output_token_ids
        assert got == want, blocks
