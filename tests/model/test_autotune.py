"""Choosing by measurement (autotune.py): the pure choice function on made-up figures, the
candidates a CPU gets, a real measurement and its per-machine cache on a tiny checkpoint, and a
quantized stage packed for bf16 kernels under fp32 activations against its dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.model import autotune
from swarm.model.autotune import Candidate, candidates, choose
from swarm.model.config import ModelArgs
from swarm.model.generate import LocalModel, generate
from swarm.model.quant import QuantLinear, quantize_block
from swarm.testing.checkpoints import TinySpec, write_checkpoint

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17]


def C(key: str) -> Candidate:
    return Candidate.from_key(key)


def test_choose_takes_the_fastest_when_it_is_clearly_faster() -> None:
    order = candidates("none", [1, 2])
    ms = {C("fp32/same/1"): 10.0, C("fp32/same/2"): 9.8, C("bf16/same/1"): 5.0, C("bf16/same/2"): 7.0}
    assert choose(ms, order) == C("bf16/same/1")


def test_a_close_race_goes_to_fp32_and_to_fewer_threads() -> None:
    order = candidates("none", [1, 2])
    # bf16 4% faster: within the margin, so fp32 (exact across CPUs) wins; 2 threads 3% faster: 1 thread
    ms = {C("fp32/same/1"): 10.0, C("fp32/same/2"): 9.7, C("bf16/same/1"): 9.6, C("bf16/same/2"): 9.6}
    assert choose(ms, order) == C("fp32/same/1")
    assert choose(ms, order, margin=0.0) == C("bf16/same/1")  # the first of the equally fastest


def test_threads_never_slow_a_stage_down() -> None:
    """A second thread that measured slower (a loaded machine) is never chosen."""
    order = candidates("none", [1, 2], dtypes=("fp32",))
    assert choose({C("fp32/same/1"): 8.0, C("fp32/same/2"): 140.0}, order) == C("fp32/same/1")
    assert choose({C("fp32/same/1"): 8.0, C("fp32/same/2"): 4.5}, order) == C("fp32/same/2")


def test_a_quantized_fp32_stage_takes_the_packed_kernel_when_dequantizing_is_slower() -> None:
    order = candidates("int4", [1], dtypes=("fp32",))
    assert order == [C("fp32/same/1"), C("fp32/bf16/1")]
    assert choose({C("fp32/same/1"): 31.5, C("fp32/bf16/1"): 0.42}, order) == C("fp32/bf16/1")
    assert choose({C("fp32/same/1"): 0.40, C("fp32/bf16/1"): 0.42}, order) == C("fp32/same/1")


def test_unmeasured_candidates_are_ignored_and_none_is_an_error() -> None:
    order = candidates("none", [1, 2])
    assert choose({C("bf16/same/2"): 3.0}, order) == C("bf16/same/2")
    with pytest.raises(ValueError, match="no candidate"):
        choose({}, order)


def test_candidates_in_order_of_preference() -> None:
    assert [c.key for c in candidates("int8", [2, 1])] == [
        "fp32/same/1", "fp32/same/2", "fp32/bf16/1", "fp32/bf16/2", "bf16/same/1", "bf16/same/2",
    ]
    assert [c.key for c in candidates("none", [1], dtypes=("bf16",))] == ["bf16/same/1"]
    # an explicit dtype keeps a ring's kernels: no cast of fp32 activations to bf16
    assert [c.key for c in candidates("int4", [1], dtypes=("fp32",), casts=False)] == ["fp32/same/1"]
    assert C("fp32/bf16/3").kernel_dtype() is torch.bfloat16 and C("fp32/same/3").kernel_dtype() is None


def test_tune_measures_once_and_caches_per_machine_and_shape(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(family="llama"), seed=0)
    args = ModelArgs.from_dir(ckpt)
    path = tmp_path / "autotune.json"
    first = autotune.tune(args, "int4", threads=[1], path=path)
    assert set(first.ms) == {"fp32/same/1", "fp32/bf16/1", "bf16/same/1"}
    assert all(v > 0 for v in first.ms.values())
    assert first.best == choose({C(k): v for k, v in first.ms.items()}, candidates("int4", [1]))
    saved = json.loads(path.read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["best"] == first.best.key
    # the same machine and shape: the cached choice, not a new measurement (figures equal)
    again = autotune.tune(args, "int4", threads=[1], path=path)
    assert again.best == first.best and again.ms == first.ms
    # another quantization is another entry; an unreadable cache is measured over, not an error
    autotune.tune(args, "none", dtypes=("fp32",), threads=[1], path=path)
    assert len(json.loads(path.read_text())) == 2
    path.write_text("not json")
    assert autotune.tune(args, "none", dtypes=("fp32",), threads=[1], path=path).best == C("fp32/same/1")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fp32_activations_through_bf16_packed_kernels(kind: str) -> None:
    """A linear packed in bf16 under fp32 activations: fp32 in and out, the packed kernel, and the
    product of its own (bf16-rounded) input with the weight it holds."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 128, generator=g) * 0.05)
    block = torch.nn.Sequential(lin)
    quantize_block(block, kind, dtype=torch.float32, kernel_dtype=torch.bfloat16)
    q = block[0]
    assert isinstance(q, QuantLinear) and q.kernel in ("int8pack", "int4pack_cpu")
    x = torch.randn(3, 128, generator=g)
    y = q(x)
    assert y.dtype == torch.float32 and y.shape == (3, 64)
    want = x.to(torch.bfloat16).float() @ q.dequantized().T
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)  # the kernel rounds its output to bf16


def test_a_stage_packed_for_bf16_kernels_generates_the_same_tokens_every_time(tmp_path: Path) -> None:
    """Determinism (what a replay relies on): the same choice gives the same tokens twice, and the
    stage split does not change them (every split computes the same chunks)."""
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(family="llama"), seed=1)
    outs = []
    for stages in (1, 2, 1):
        lm = LocalModel.load(ckpt, stages=stages, dtype=torch.float32, quant="int4", kernel_dtype=torch.bfloat16)
        outs.append(generate(lm, PROMPT, max_new_tokens=8).output_token_ids)
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
