"""A quantized swarm's coordinator serving narrower than fp32 holds the LM head as ``run --quant
auto`` does (int8 where the checkpoint stores it in 5 to 8 bits and this device has an int8 kernel:
capability.swarm_head_quant), counts it in its budget (ModelArgs.head_int8_bytes, in memory, not
disk) and names it in receipts; a dense swarm's head, and an fp32 one's, stay dense. On the bundled model (its tied head stored Q8_0) one token's head costs 7.0 ms dense and
2.0 ms int8 (benchmarks/results/head_matmul.json), the largest single cost of a ring's token."""

from __future__ import annotations

import pytest
import torch

from swarm.model.bundled import default_model_dir
from swarm.model.capability import choose_head_quant
from swarm.model.weights import open_checkpoint
from swarm.node.compute.runtime import Compute, Models
from swarm.node.notices import Hooks, Notices
from swarm.node.settings import NodeSettings, model_spec
from swarm.testing.checkpoints import TinySpec, write_checkpoint


def test_a_checkpoint_says_how_its_head_is_stored(tmp_path) -> None:
    assert open_checkpoint(default_model_dir()).args.head_stored == "int8"  # the Q4_1 GGUF's Q8_0 embedding
    assert open_checkpoint(write_checkpoint(tmp_path / "f", TinySpec(n_layers=1), seed=0)).args.head_stored == "none"


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantized_swarms_budget_counts_the_int8_head_below_fp32_a_dense_ones_does_not(quant: str) -> None:
    args = open_checkpoint(default_model_dir()).args
    dense, spec = model_spec(args, torch.bfloat16, 512, "none"), model_spec(args, torch.bfloat16, 512, quant)
    assert spec.coordinator_bytes == dense.coordinator_bytes == args.head_bytes(2)  # disk: the checkpoint's head
    assert dense.coordinator_at(1) == dense.coordinator_bytes + dense.head_session_bytes()
    assert spec.coordinator_at(1) == spec.coordinator_bytes + args.head_int8_bytes() + spec.head_session_bytes()
    fp32 = spec.at_width(4)  # an fp32 coordinator keeps the head dense (capability.swarm_head_quant)
    assert fp32.coordinator_at(1) == fp32.coordinator_bytes + fp32.head_session_bytes()
    assert args.head_int8_bytes() >= args.vocab_size * args.dim  # at least the packed integers


@pytest.mark.parametrize(("quant", "dtype"), [("none", torch.bfloat16), ("int4", torch.bfloat16), ("int4", torch.float32)])
async def test_the_coordinator_holds_the_head_as_its_swarms_quant_and_dtype_say(quant: str, dtype: torch.dtype) -> None:
    settings = NodeSettings(seed=b"s" * 32, swarm_id="s", secret=b"x" * 32, model_dir=default_model_dir(),
                            dtype=dtype, quant=quant)  # fmt: skip
    models = Models(settings, Compute(threads=False), Notices(Hooks()))
    assert models.head_quant == "none"  # nothing loaded yet
    head = await models.head()
    int8 = quant != "none" and dtype != torch.float32
    want = choose_head_quant("int8", torch.device("cpu"), dtype) if int8 else "none"
    assert head.head_quant == models.head_quant == want
