"""The activation codec at a boundary between peers of different dtypes: hidden states of any
float wire dtype are checked and cast to the receiving stage's dtype; anything else is refused."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ProtocolError
from swarm.node.ring.codec import decode_hidden, encode_hidden
from swarm.proto.frame import DType


@pytest.mark.parametrize("sent", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("serves", [torch.float32, torch.bfloat16, torch.float16])
def test_any_float_dtype_arrives_cast_to_the_stages_own(sent: torch.dtype, serves: torch.dtype) -> None:
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(sent)
    got = decode_hidden(*encode_hidden(h), dim=8, expect=serves, peer="up")
    assert got.dtype == serves
    assert torch.equal(got, h.to(serves))  # exactly the cast one process would make


def test_non_float_or_non_finite_hidden_states_are_refused() -> None:
    with pytest.raises(ProtocolError, match="peer up: hidden states of dtype INT32, expected bf16, fp16 or fp32"):
        decode_hidden(DType.INT32, (1, 8), bytes(32), dim=8, expect=torch.float32, peer="up")
    bad = torch.full((1, 8), float("inf"), dtype=torch.bfloat16)
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        decode_hidden(*encode_hidden(bad), dim=8, expect=torch.float32, peer="up")
