"""gpt-oss checkpoints as released: MXFP4 experts (``*_blocks``/``*_scales``) dequantized as a
stage loads them, through transformers' own MXFP4 integration, to exactly the weights the format
encodes (decoded independently in swarm/testing/hf_checkpoints.py from the OCP MX element table),
every split greedy-identical to transformers, and kept compact again with --quant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarm.errors import ConfigError
from swarm.model.config import ModelArgs
from swarm.model.generate import LocalModel, generate
from swarm.model.quant import QuantExperts, layer_bytes_each
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import contiguous_splits
from swarm.testing.hf_checkpoints import (
    family_config,
    mxfp4_decode,
    mxfp4_encode,
    write_mxfp4_gpt_oss,
)

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
PROMPT = [1, 5, 9, 33, 7, 100, 3, 44, 12, 19, 200, 150]
NEW = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "oss", seed=1)


def test_the_test_encoder_round_trips_the_format() -> None:
    w = torch.randn(3, 8, 64)
    blocks, scales = mxfp4_encode(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2) and blocks.dtype == torch.uint8
    back = mxfp4_decode(blocks, scales)
    assert torch.equal(mxfp4_decode(*mxfp4_encode(back)), back)  # representable values come back exactly
    assert float((back - w).abs().max()) <= float(w.abs().max()) / 4  # within a step of the coarsest block


def test_experts_are_dequantized_to_what_the_blocks_encode(ckpt: Path) -> None:
    ck = open_checkpoint(ckpt)
    assert ck.args.config["quantization_config"]["quant_method"] == "mxfp4"
    raw = load_file(str(ckpt / "model.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        st = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=dtype)
        for i, layer in enumerate(st.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = f"model.layers.{i}.mlp.experts.{proj}"
                want = mxfp4_decode(raw[p + "_blocks"], raw[p + "_scales"]).transpose(1, 2)  # (E, in, out)
                got = getattr(layer.mlp.experts, proj)
                assert got.dtype == dtype and torch.equal(got.float(), want.to(dtype).float()), (p, dtype)
        resident = [sum(t.numel() * t.element_size() for t in [*x.parameters(), *x.buffers()]) for x in st.layers]
        assert resident == layer_bytes_each(ck.args, "none", dtype.itemsize)


def test_every_split_matches_transformers_on_the_mxfp4_checkpoint(ckpt: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.int64),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
    ref = out[0, len(PROMPT):].tolist()
    assert len(set(ref)) > 3
    for blocks in contiguous_splits(3):
        got = generate(LocalModel.load(ckpt, stages=blocks, dtype=torch.float32), PROMPT, max_new_tokens=NEW,
                       eos_token_ids=()).output_token_ids  # fmt: skip
        assert got == ref, blocks


def test_mxfp4_experts_kept_compact_with_quant(ckpt: Path) -> None:
    one = LocalModel.load(ckpt, stages=1, dtype=torch.float32, quant="int4")
    assert sum(isinstance(m, QuantExperts) for m in one.stages[0].modules()) == 3
    want = generate(one, PROMPT, max_new_tokens=NEW, eos_token_ids=()).output_token_ids
    for blocks in contiguous_splits(3)[1:]:
        got = generate(LocalModel.load(ckpt, stages=blocks, dtype=torch.float32, quant="int4"), PROMPT,
                       max_new_tokens=NEW, eos_token_ids=()).output_token_ids  # fmt: skip
        assert got == want, blocks


def test_other_quantized_checkpoints_are_refused_by_name() -> None:
    oss = family_config("gpt_oss").to_dict()
    with pytest.raises(ConfigError, match=r"GptOssForCausalLM weights quantized with 'fp8' are not supported.*mxfp4"):
        ModelArgs.from_config({**oss, "quantization_config": {"quant_method": "fp8"}})
    qwen = family_config("qwen3").to_dict()
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM weights quantized with 'mxfp4'"):
        ModelArgs.from_config({**qwen, "quantization_config": {"quant_method": "mxfp4"}})


def test_mxfp4_stays_mxfp4_at_rest_and_serves_the_same_numbers(ckpt: Path) -> None:
    """--quant mxfp4: the experts keep the file's codes and exponents (4.25 bits per weight), the
    attention and router stay dense, the planner's budget is what the stage holds, and the layer
    computes what the dequantized-at-load stage computes."""
    from swarm.model.quant_formats import mxfp4_to_float

    ck = open_checkpoint(ckpt)
    raw = load_file(str(ckpt / "model.safetensors"))
    compact = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=torch.float32, quant="mxfp4")
    dense = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=torch.float32)
    for i, layer in enumerate(compact.layers):
        ex = layer.mlp.experts
        assert isinstance(ex, QuantExperts) and ex.kernels == {"gate_up_proj": "dequant", "down_proj": "dequant"}
        for proj in ("gate_up_proj", "down_proj"):
            codes, scales = getattr(ex, f"{proj}_qweight"), getattr(ex, f"{proj}_scales")
            assert codes.dtype == scales.dtype == torch.uint8
            p = f"model.layers.{i}.mlp.experts.{proj}"
            want = mxfp4_decode(raw[p + "_blocks"], raw[p + "_scales"])  # (E, out, in)
            assert torch.equal(mxfp4_to_float(codes, scales), want), p  # the same values at rest
            assert codes.numel() == want.numel() // 2 and scales.numel() == want.numel() // 32
        assert not any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.uint8 for m in layer.modules())
    held = [sum(t.numel() * t.element_size() for t in [*x.parameters(), *x.buffers()]) for x in compact.layers]
    assert held == layer_bytes_each(ck.args, "mxfp4", 4)
    h = torch.randn(5, ck.args.dim, generator=torch.Generator().manual_seed(0))
    for st in (compact, dense):
        st.open_session("s", 16)
    torch.testing.assert_close(compact.forward("s", h), dense.forward("s", h), rtol=1e-5, atol=1e-5)


def test_mxfp4_encoder_is_exact_on_decoded_mxfp4_and_bounded_on_floats() -> None:
    from swarm.model.quant_formats import mxfp4_from_float, mxfp4_to_float

    w = torch.randn(6, 96) * 0.05
    codes, scales = mxfp4_from_float(w)
    back = mxfp4_to_float(codes, scales)
    assert torch.equal(mxfp4_to_float(*mxfp4_from_float(back)), back)
    blocks, sc = mxfp4_encode(w)  # the independent encoder of the test checkpoints
    assert torch.equal(back, mxfp4_decode(blocks, sc))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(mxfp4_to_float(codes, scales, dtype).float(), back)  # exact in 16 bits
    with pytest.raises(ConfigError, match="not a multiple of its block of 32"):
        mxfp4_from_float(torch.randn(4, 40))


def test_one_host_transfer_per_moe_layer(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact experts' forward syncs with the host once per layer (the expert counts), not
    once per expert hit: no unique, nonzero/where, bincount or item in it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"aten._unique2.default", "aten.unique_dim.default", "aten.nonzero.default",
               "aten._local_scalar_dense.default", "aten.bincount.default", "aten.masked_select.default"}
    ck = open_checkpoint(ckpt)
    st = Stage.load(ck.args, ck.source, 0, 1, dtype=torch.float32, quant="mxfp4")
    ex = st.layers[0].mlp.experts
    transfers: list[int] = []
    real_tolist = torch.Tensor.tolist

    def tolist(t: torch.Tensor) -> object:
        transfers.append(t.numel())
        return real_tolist(t)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, ck.args.dim, generator=g)
    k = int(ck.args.config["num_experts_per_tok"])
    idx = torch.stack([torch.randperm(ex.num_experts, generator=g)[:k] for _ in range(7)])  # (T, k)
    w = torch.softmax(torch.randn(7, k, generator=g), -1)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with Count() as c:
        ex(h, idx, w)
    assert [op for op in c.ops if op in syncing] == []
    assert transfers == [ex.num_experts + 1]  # one small transfer: the per-expert counts
