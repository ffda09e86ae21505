"""The activation codec (node/ring/codec.py): tensors <-> CHUNK/RESULT, through real frame bytes,
and every check a peer's bytes get. Encoding is a bit copy, so the round trip is exact in every
dtype on every CPU (no arithmetic happens)."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ProtocolError
from swarm.node.ring.codec import (
    REPLAY_ID_BASE,
    decode_hidden,
    encode_hidden,
    hidden_chunk,
    hidden_result,
    is_replay,
    read_hidden,
    wire_dtype,
)
from swarm.proto.frame import DType, encode_frame
from swarm.proto.messages import Chunk, Result, decode_message

D = 16


def _wire(msg: Chunk | Result) -> Chunk | Result:
    """What the next peer parses: the message through its frame's bytes."""
    out = decode_message(encode_frame(msg.to_frame()))
    assert isinstance(out, type(msg))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunk_and_result_round_trip_bit_for_bit(dtype: torch.dtype) -> None:
    h = torch.randn(3, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    chunk = _wire(hidden_chunk(7, 11, 40, "verify", h, epoch=3))
    assert (chunk.session, chunk.chunk_id, chunk.pos, chunk.mode, chunk.epoch) == (7, 11, 40, "verify", 3)
    back = read_hidden(chunk, dim=D, expect=dtype, peer="up")
    assert back.dtype == dtype and back.shape == (3, D)
    assert torch.equal(back.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       h.view(torch.int16 if dtype != torch.float32 else torch.int32))
    result = _wire(hidden_result(7, 11, 40, encode_hidden(h), epoch=3))  # pre-encoded, as off the loop
    assert result.kind == "hidden"
    assert torch.equal(read_hidden(result, dim=D, expect=dtype, peer="tail"), h)


def test_another_float_dtype_arrives_cast_to_the_stages_own() -> None:
    """A mixed ring (issue 29): a peer serving fp16 sends fp16, this fp32 stage computes in fp32."""
    chunk = _wire(hidden_chunk(1, 1, 0, "verify", torch.ones(2, D, dtype=torch.float16), epoch=0))
    h = read_hidden(chunk, dim=D, expect=torch.float32, peer="bob")
    assert h.dtype == torch.float32 and torch.equal(h, torch.ones(2, D))


@pytest.mark.parametrize("shape", [(2, D + 1), (2, 3, D), (D,)])
def test_a_wrong_shape_is_refused(shape: tuple[int, ...]) -> None:
    data = torch.zeros(shape, dtype=torch.float32).numpy().tobytes()
    with pytest.raises(ProtocolError, match=rf"peer carol: hidden states of shape .*expected \(T, {D}\)"):
        decode_hidden(DType.FP32, shape, data, dim=D, expect=torch.float32, peer="carol")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_values_are_refused(bad: float, dtype: torch.dtype) -> None:
    h = torch.zeros(2, D, dtype=dtype)
    h[1, 5] = bad
    chunk = _wire(hidden_chunk(1, 2, 0, "decode", h, epoch=0))
    with pytest.raises(ProtocolError, match="peer dave: hidden states contain NaN or Inf"):
        read_hidden(chunk, dim=D, expect=dtype, peer="dave")


def test_only_serving_dtypes_travel() -> None:
    assert wire_dtype(torch.bfloat16) is DType.BF16
    with pytest.raises(ProtocolError, match="cannot travel on the activation path"):
        encode_hidden(torch.zeros(1, D, dtype=torch.float64))


def test_replay_ids_sit_above_the_decoders_own() -> None:
    assert not is_replay(0) and not is_replay(REPLAY_ID_BASE - 1)
    assert is_replay(REPLAY_ID_BASE) and is_replay(REPLAY_ID_BASE + 5)
