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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_values_are_refused(bad: float, dtype: torch.dtype) -> None:
    h = torch.zeros(2, D, dtype=dtype)
    h[1, 5] = bad
    chunk = _wire(hidden_chunk(1, 2, 0, "decode", h, epoch=0))
    with pytest.raises(ProtocolError, match="peer dave: hidden states contain NaN or Inf"):
        read_hidden(chunk, dim=D, expect=dtype, peer="dave")


@pytest.mark.parametrize(("wire", "dtype", "mantissa"), [(DType.BF16, torch.bfloat16, 7), (DType.FP16, torch.float16, 10)])
def test_the_finiteness_check_refuses_exactly_what_isfinite_does(wire: DType, dtype: torch.dtype, mantissa: int) -> None:
    """The check reads exponent bits, not values: every exponent, both signs, the mantissa's
    lowest, highest and a middle value: refused iff not finite."""
    m = (1 << mantissa) - 1
    patterns = [sign | e << mantissa | f for sign in (0, 1 << 15) for e in range(1 << (15 - mantissa)) for f in (0, 1, m >> 1, m)]
    every = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(every)
    for i in range(every.numel()):
        h = every[i : i + 1].reshape(1, 1)
        try:
            decode_hidden(wire, (1, 1), h.view(torch.int16).numpy().tobytes(), dim=1, expect=dtype, peer="x")
        except ProtocolError:
            assert not finite[i], f"refused the finite {h.item()}"
        else:
            assert finite[i], f"accepted {h.item()}"


def test_the_largest_and_smallest_fp32_values_pass() -> None:
    info = torch.finfo(torch.float32)
    h = torch.tensor([[info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 1.0]], dtype=torch.float32)
    assert torch.equal(decode_hidden(DType.FP32, (1, 6), h.numpy().tobytes(), dim=6, expect=torch.float32, peer="x"), h)


def test_only_serving_dtypes_travel() -> None:
    assert wire_dtype(torch.bfloat16) is DType.BF16
    with pytest.raises(ProtocolError, match="cannot travel on the activation path"):
        encode_hidden(torch.zeros(1, D, dtype=torch.float64))


def test_replay_ids_sit_above_the_decoders_own() -> None:
    assert not is_replay(0) and not is_replay(REPLAY_ID_BASE - 1)
    assert is_replay(REPLAY_ID_BASE) and is_replay(REPLAY_ID_BASE + 5)
