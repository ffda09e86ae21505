"""The activation codec: tensors <-> activation-path messages, with the checks that bytes from
another peer need. The messages' wire schema (shapes, tokens per chunk, positions) is
``swarm.proto.messages``; this module is the only place a tensor becomes bytes or back.

A hidden state travels as raw bytes in the serving dtype (bf16 as its int16 bit pattern, fp16,
fp32): exactly the values the next stage would have received in one process, so a ring computes
the same numbers as the in-process reference. Everything that arrives is checked before use:
dtype, rank, hidden size, token count and finiteness. A violation is a ProtocolError that names
the peer and the field; the caller treats that peer as faulty.

Devices: a stage on a GPU hands its output here and ``encode_hidden`` copies it to the host once
(``.cpu()``, which waits for the stage's kernels); ``decode_hidden`` returns a host tensor that
the next Stage moves to its device once, in ``Stage.forward``. On a CPU neither is a copy. No
pinned staging buffers: a hidden state is 2-4 bytes x hidden size per token (kilobytes per
decode step), so pinning saves microseconds per hop against a hop cost of ~1.4 ms on loopback,
and allocating pinned memory per message would cost more than it saves (not yet measured on a
GPU; benchmarks/gpu_check.py times the ring there).
"""

from __future__ import annotations

import numpy as np
import torch

from swarm.errors import ProtocolError
from swarm.proto.frame import DType
from swarm.proto.messages import Chunk, Result

Encoded = tuple[DType, tuple[int, ...], bytes]

# chunk ids of chunks a coordinator replays after a re-plan (coordinator.py; a stage computes a
# session's queued ones together, stage_worker.py); the decoder's own ids stay far below
REPLAY_ID_BASE = 1 << 48


def is_replay(chunk_id: int) -> bool:
    return chunk_id >= REPLAY_ID_BASE

_TO_WIRE = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16, torch.float32: DType.FP32}
_FROM_WIRE = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}
_EXPONENT = {DType.BF16: (np.uint16, 0x7F80), DType.FP16: (np.uint16, 0x7C00), DType.FP32: (np.uint32, 0x7F800000)}


def wire_dtype(dtype: torch.dtype) -> DType:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot travel on the activation path") from None


def encode_hidden(h: torch.Tensor) -> Encoded:
    """(T, D) tensor -> (wire dtype, shape, raw little-endian bytes)."""
    h = h.detach().contiguous().cpu()
    dt = wire_dtype(h.dtype)
    raw = h.view(torch.int16) if h.dtype == torch.bfloat16 else h
    return dt, tuple(h.shape), raw.numpy().tobytes()


def decode_hidden(
    dtype: DType, shape: tuple[int, ...], data: bytes, *, dim: int, expect: torch.dtype, peer: str
) -> torch.Tensor:
    """Raw bytes from ``peer`` -> a (T, dim) tensor of ``expect`` dtype, or ProtocolError.

    A ring may mix dtypes (an fp32 CPU peer beside bf16 GPUs): hidden states of any float wire
    dtype are accepted, checked in that dtype, and cast here, at the boundary, to the dtype this
    stage computes in (what one process holding both stages in those dtypes would do)."""
    if dtype not in _FROM_WIRE:
        raise ProtocolError(f"peer {peer}: hidden states of dtype {dtype.name}, expected bf16, fp16 or fp32")
    if len(shape) != 2 or shape[1] != dim or shape[0] < 1:
        raise ProtocolError(f"peer {peer}: hidden states of shape {shape}, expected (T, {dim})")
    # NaN and Inf are the values whose exponent bits are all set: one masked max over the raw
    # bits finds them (in a ring each call here follows an idle wait, when every distinct op
    # costs ~20x its warm time: two numpy ops instead of numpy, isfinite, all and a sync)
    bits, exponent = _EXPONENT[dtype]
    if int((np.frombuffer(data, dtype=bits) & exponent).max()) == exponent:
        raise ProtocolError(f"peer {peer}: hidden states contain NaN or Inf (shape {shape})")
    t = torch.frombuffer(bytearray(data), dtype=_FROM_WIRE[dtype]).view(shape)
    return t if t.dtype == expect else t.to(expect)


def hidden_chunk(
    session: int, chunk_id: int, pos: int, mode: str, h: torch.Tensor | Encoded, epoch: int, flags: int = 0
) -> Chunk:
    """A CHUNK carrying hidden states ``h`` (T, D) (or their encoding, made off the trio loop)."""
    dt, shape, data = encode_hidden(h) if isinstance(h, torch.Tensor) else h
    return Chunk(session, chunk_id, pos, mode, dt, shape, data, epoch, flags)


def hidden_result(session: int, chunk_id: int, pos: int, h: torch.Tensor | Encoded, epoch: int) -> Result:
    """The tail's RESULT for one chunk: its hidden states (the coordinator holds the head)."""
    dt, shape, data = encode_hidden(h) if isinstance(h, torch.Tensor) else h
    return Result(session, chunk_id, pos, "hidden", dt, shape, data, epoch)


def read_hidden(msg: Chunk | Result, *, dim: int, expect: torch.dtype, peer: str) -> torch.Tensor:
    """The checked (T, dim) hidden states a CHUNK or a RESULT(hidden) from ``peer`` carries."""
    return decode_hidden(msg.dtype, msg.shape, msg.data, dim=dim, expect=expect, peer=peer)
