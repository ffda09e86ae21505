"""The activation path's messages: chunks, results, rollbacks, session ends and errors.

A CHUNK carries token ids (coordinator -> first stage) or hidden states (stage -> stage) for
positions ``pos .. pos+T-1`` of one session; the tail answers with a RESULT. Both carry their
tensor as the frame's payload: token ids are (T,) or (B, T) ints, hidden states (T, D) or
(B, T, D) floats (bf16 as its int16 bit pattern), bounded by :class:`~swarm.proto.limits.Limits`
(tokens per chunk, batch, positions). Turning tensors into these messages and back, with the
checks a peer's bytes need (dtype, hidden size, finiteness), is ``swarm.node.ring.codec``.

Header use: ``session`` is the generation session (never 0), ``seq`` the chunk id, ``flags``
the frame flags; ERROR may be sent about no session (0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from swarm.errors import ProtocolError
from swarm.proto.fields import Int, Str, Word, header, meta
from swarm.proto.frame import DType, Frame, MsgType
from swarm.proto.limits import Limits
from swarm.proto.messages import I63, Message, register

CHUNK_MODES = ("prefill", "verify", "decode")
RESULT_KINDS = ("hidden", "logits", "tokens")


def tokens_axis(name: str, dtype: DType, shape: tuple[int, ...], limits: Limits) -> int:
    """T of a chunk: tokens are (T,) or (B, T) ints; hidden states (T, D) or (B, T, D) floats."""
    if not (dtype.is_int or dtype.is_float):
        raise ProtocolError(f"{name} field 'dtype': {dtype.name}, a chunk carries token ids or hidden states")
    if dtype.is_int:
        if len(shape) not in (1, 2):
            raise ProtocolError(f"{name} field 'shape': token ids are (T,) or (B, T), got {shape}")
        t = shape[-1]
    else:
        if len(shape) not in (2, 3):
            raise ProtocolError(f"{name} field 'shape': hidden states are (T, D) or (B, T, D), got {shape}")
        t = shape[-2]
        if shape[-1] == 0:
            raise ProtocolError(f"{name} field 'shape': hidden size 0")
    if len(shape) == (2 if dtype.is_int else 3) and not 1 <= shape[0] <= limits.max_batch:
        raise ProtocolError(f"{name} field 'shape': batch {shape[0]} outside 1..{limits.max_batch} (limit max_batch)")
    if not 1 <= t <= limits.max_tokens_per_chunk:
        raise ProtocolError(
            f"{name} field 'shape': {t} tokens outside 1..{limits.max_tokens_per_chunk} (limit max_tokens_per_chunk)"
        )
    return t


class _Tensor(Message):
    FRAME: ClassVar[str] = "tensor"
    pos: int
    dtype: DType
    shape: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.shape[-1] if self.dtype.is_int else self.shape[-2]

    @classmethod
    def check_frame(cls, frame: Frame, limits: Limits) -> None:
        super().check_frame(frame, limits)
        tokens_axis(cls.TYPE.name, frame.dtype, frame.shape, limits)

    def check(self, limits: Limits, fail: Any) -> None:
        if self.pos > limits.max_position - self.tokens:
            raise fail("pos", f"{self.pos} outside 0..{limits.max_position - self.tokens}")


@register
@dataclass(frozen=True, slots=True)
class Chunk(_Tensor):
    """Activation / verify chunk of ``session`` at positions ``pos .. pos+T-1``; ``data`` is the
    raw tensor bytes."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    session: int = header("session")
    chunk_id: int = header("seq")
    pos: int = meta("pos", Int(0, lambda lim: lim.max_position))
    mode: str = meta("mode", Str(16, choices=CHUNK_MODES))  # "prefill" | "verify" | "decode"
    dtype: DType = header("dtype")
    shape: tuple[int, ...] = header("shape")
    data: bytes = header("payload")
    epoch: int = meta("epoch", Int(0, I63), default=0)
    flags: int = header("flags", default=0)

    def __repr__(self) -> str:
        return (
            f"Chunk(session={self.session}, chunk_id={self.chunk_id}, pos={self.pos}, mode={self.mode}, "
            f"{self.dtype.name}{list(self.shape)}, epoch={self.epoch})"
        )


@register
@dataclass(frozen=True, slots=True)
class Result(_Tensor):
    """What the tail returns to the coordinator for one chunk: hidden states, logits or top tokens."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    session: int = header("session")
    chunk_id: int = header("seq")
    pos: int = meta("pos", Int(0, lambda lim: lim.max_position))
    kind: str = meta("kind", Str(16, choices=RESULT_KINDS))  # "hidden" | "logits" | "tokens"
    dtype: DType = header("dtype")
    shape: tuple[int, ...] = header("shape")
    data: bytes = header("payload")
    epoch: int = meta("epoch", Int(0, I63), default=0)

    def __repr__(self) -> str:
        return (
            f"Result(session={self.session}, chunk_id={self.chunk_id}, pos={self.pos}, kind={self.kind}, "
            f"{self.dtype.name}{list(self.shape)})"
        )

    def check(self, limits: Limits, fail: Any) -> None:
        if (self.kind == "tokens") != self.dtype.is_int:
            raise fail("kind", f"{self.kind} does not match dtype {self.dtype.name}")
        _Tensor.check(self, limits, fail)


@register
@dataclass(frozen=True, slots=True)
class Rollback(Message):
    """Truncate ``session``'s KV cache to ``length`` positions (drop rejected drafts)."""

    TYPE: ClassVar[MsgType] = MsgType.ROLLBACK
    FRAME: ClassVar[str] = "session"
    session: int = header("session")
    length: int = meta("len", Int(0, lambda lim: lim.max_position))
    epoch: int = meta("epoch", Int(0, I63), default=0)


@register
@dataclass(frozen=True, slots=True)
class SessionEnd(Message):
    """The session is over: free its caches."""

    TYPE: ClassVar[MsgType] = MsgType.SESSION_END
    FRAME: ClassVar[str] = "session"
    session: int = header("session")


@register
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A peer reports that it could not handle ``chunk_id`` of ``session`` (0 = not session-bound)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    FRAME: ClassVar[str] = "any"
    session: int = header("session")
    chunk_id: int = header("seq")
    code: str = meta("code", Word(32))  # short machine-readable word, e.g. "bad_tensor", "overloaded"
    message: str = meta("msg", Str(1024), default="")
