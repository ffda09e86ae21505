"""A quantized swarm's coordinator holds the LM head as ``run --quant auto`` does (int8 where the
checkpoint stores it in 5 to 8 bits and this device has an int8 kernel: capability.swarm_head_quant),
counts it in its budget (ModelArgs.head_int8_bytes) and names it in receipts; a dense swarm's head
stays dense. On the bundled model (its tied head stored Q8_0) one token's head costs 6.9 ms dense and
1.1 ms int8 here, the largest single cost of a ring's token."""

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
def test_a_quantized_swarms_budget_counts_the_int8_head_a_dense_ones_does_not(quant: str) -> None:
    args = open_checkpoint(default_model_dir()).args
    dense = model_spec(args, torch.bfloat16, 512, "none").coordinator_bytes
    assert dense == args.head_bytes(2)
    assert model_spec(args, torch.bfloat16, 512, quant).coordinator_bytes == dense + args.head_int8_bytes()
    assert args.head_int8_bytes() >= args.vocab_size * args.dim  # at least the packed integers


@pytest.mark.parametrize("quant", ["none", "int4"])
async def test_the_coordinator_holds_the_head_as_its_swarms_quant_says(quant: str) -> None:
    settings = NodeSettings(seed=b"s" * 32, swarm_id="s", secret=b"x" * 32, model_dir=default_model_dir(),
                            dtype=torch.bfloat16, quant=quant)  # fmt: skip
    models = Models(settings, Compute(threads=False), Notices(Hooks()))
    assert models.head_quant == "none"  # nothing loaded yet
    head = await models.head()
    want = "none" if quant == "none" else choose_head_quant("int8", torch.device("cpu"), torch.bfloat16)
    assert head.head_quant == models.head_quant == want
