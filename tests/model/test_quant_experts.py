"""MoE experts kept compact: every family's fused experts quantized per expert, multiplied by the
weights they hold, the planner's bytes equal to what a stage keeps resident, and every split of
a quantized tiny MoE checkpoint token-identical to the same quantization in one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from swarm.errors import ConfigError
from swarm.model.generate import LocalModel, generate
from swarm.model.quant import QuantExperts, QuantLinear, layer_bytes_each, quantize_block
from swarm.model.quant_experts import experts_paths
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import contiguous_splits
from swarm.testing.hf_checkpoints import family_config, write_family_checkpoint

transformers = pytest.importorskip("transformers")

MOE = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe")
# DeepSeek's tiny kv_lora_rank of 16 is no multiple of an int4 group; real ones are (512)
OVERRIDES = {"deepseek_v3": {"kv_lora_rank": 32}}
PROMPT = [1, 5, 9, 33, 7, 100, 3, 44, 12, 19, 200, 150]


def _experts(family: str, seed: int = 0) -> nn.Module:
    """The experts module of layer 1 (a MoE layer in every family here), random weights, fp32."""
    torch.manual_seed(seed)
    cfg = family_config(family, **OVERRIDES.get(family, {}))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return experts.eval()


def _routing(experts: nn.Module, t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e, d = int(experts.num_experts), int(experts.config.hidden_size)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])  # (T, 2) distinct experts
    w = torch.rand(t, 2, generator=g)
    return x, idx, w


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", MOE)
def test_compact_experts_compute_what_the_family_computes_with_their_weights(family: str, kind: str) -> None:
    """fp32 (dequant path): the family's own forward, given the dequantized weights, agrees."""
    experts = _experts(family)
    layer = nn.Sequential()
    layer.add_module("experts", copy.deepcopy(experts))
    quantize_block(layer, kind)
    q = layer.experts
    assert isinstance(q, QuantExperts) and experts_paths(layer) == []
    assert set(q.kernels.values()) == {"dequant"}
    x, idx, w = _routing(experts, 7)
    with torch.no_grad():
        for name in q.layouts:
            deq = q.dequantized(name)  # (E, N, K)
            orig = getattr(experts, name)
            want_shape = deq.transpose(1, 2).shape if experts.is_transposed else deq.shape
            assert orig.shape == want_shape
            # each expert quantized on its own: its error within its own scales' half step
            ref = orig.transpose(1, 2) if experts.is_transposed else orig
            err = (deq - ref).abs().amax()
            step = ref.abs().amax() / 127 if kind == "int8" else (ref.amax() - ref.amin()) / 15
            assert 0 < float(err) <= float(step) / 2 * 1.001
            orig.copy_(deq.transpose(1, 2) if experts.is_transposed else deq)
        want = experts(x, idx, w)
        got = q(x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got.abs().max()) > 0.1


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_experts_run_torch_packed_kernels(family: str, kind: str) -> None:
    experts = _experts(family).to(torch.bfloat16)
    layer = nn.Sequential()
    layer.add_module("experts", experts)
    quantize_block(layer, kind)
    q = layer.experts
    assert set(q.kernels.values()) == {"int8pack" if kind == "int8" else "int4pack_cpu"}
    x, idx, w = _routing(q.base, 5)
    with torch.no_grad():
        got = q(x.to(torch.bfloat16), idx, w.to(torch.bfloat16)).float()
        ref = torch.zeros_like(x)  # the dequantized weights multiplied out in fp32, per token
        for t in range(x.shape[0]):
            for slot in range(2):
                e = int(idx[t, slot])
                gu = q.dequantized(next(n for n in q.layouts if n != "down_proj"))[e] @ x[t]
                bias = getattr(q.base, "gate_up_proj_bias", None)
                if bias is not None:
                    gu = gu + bias[e].float()
                h = q.base._apply_gate(gu[None])[0]
                y = q.dequantized("down_proj")[e] @ h
                bias = getattr(q.base, "down_proj_bias", None)
                if bias is not None:
                    y = y + bias[e].float()
                ref[t] += float(w[t, slot]) * y
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.02, rel


def test_experts_not_loaded_are_refused() -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config("mixtral"))
    with pytest.raises(ConfigError, match="MixtralExperts.gate_up_proj: weight not loaded"):
        QuantExperts.from_experts(model.model.layers[0].mlp.experts, "int8")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: write_family_checkpoint(root / f, f, seed=1, **OVERRIDES.get(f, {})) for f in MOE}


@pytest.mark.parametrize("family", MOE)
def test_planned_layer_bytes_equal_resident_bytes(family: str, ckpts: dict[str, Path]) -> None:
    """Per layer (DeepSeek and GLM have a dense first layer), every setting, both dtypes."""
    ck = open_checkpoint(ckpts[family])
    for dtype in (torch.bfloat16, torch.float32):
        for quant in ("none", "int8", "int4"):
            st = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=dtype, quant=quant)
            resident = [sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
                        for layer in st.layers]  # fmt: skip
            assert resident == layer_bytes_each(ck.args, quant, dtype.itemsize), (family, quant, dtype)
            if quant != "none":
                assert any(isinstance(m, QuantExperts) for m in st.modules())
                assert not any(isinstance(m, nn.Linear) for m in st.modules())
                assert not any(p.dim() == 3 for p in st.parameters())  # no expert weight left in float
    each = layer_bytes_each(ck.args, "int4", 2)
    assert max(each) < 0.35 * max(layer_bytes_each(ck.args, "none", 2))
    if family in ("deepseek_v3", "glm4_moe"):
        assert each[0] < each[1]  # the dense first layer is budgeted at its own size


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_every_split_of_a_quantized_moe_checkpoint_equals_one_process(
    family: str, dtype: torch.dtype, quant: str, ckpts: dict[str, Path]
) -> None:
    """fp32 is exact on any CPU; bf16 (the packed kernels) compares this CPU with itself."""
    torch.set_num_threads(1)
    d = ckpts[family]
    one = LocalModel.load(d, stages=1, dtype=dtype, quant=quant)
    assert any(isinstance(m, QuantExperts) for m in one.stages[0].modules())
    assert any(isinstance(m, QuantLinear) for m in one.stages[0].modules())
    want = generate(one, PROMPT, max_new_tokens=12, eos_token_ids=()).output_token_ids
    assert len(set(want)) > 3
    if dtype == torch.float32:
        plain = generate(LocalModel.load(d, stages=1, dtype=dtype), PROMPT, max_new_tokens=12,
                         eos_token_ids=()).output_token_ids  # fmt: skip
        assert want != plain or quant == "int8"  # int4 really changed the model (so the splits test it)
    for blocks in contiguous_splits(3)[1:]:
        got = generate(LocalModel.load(d, stages=blocks, dtype=dtype, quant=quant), PROMPT, max_new_tokens=12,
                       eos_token_ids=()).output_token_ids  # fmt: skip
        assert got == want, blocks


@pytest.mark.parametrize("family", MOE)
def test_kv_bytes_agree_with_the_cache_a_stage_writes(family: str, ckpts: dict[str, Path]) -> None:
    """DeepSeek-V3 caches its latent (kv_lora_rank + rope dims), the others keys and values."""
    ck = open_checkpoint(ckpts[family])
    st = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=torch.bfloat16)
    st.open_session("s", 10)
    st("s", torch.randn(10, ck.args.dim))
    assert st._cache("s").nbytes() == ck.args.n_layers * 10 * ck.args.kv_bytes_per_token_per_layer(2)
