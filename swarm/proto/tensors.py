"""/shard-swarm/tensors/1: byte ranges of the model's files, asked of a member that holds them.

A stream carries one request at a time: the fetcher sends RANGE_REQUEST (``session`` = its
request id, never 0) naming a file of the model manifest, an offset and a length; the server
answers with RANGE_DATA frames (raw bytes, dtype U8, at most ``Limits.max_range_chunk`` each, in
order, the last flagged LAST) or one RANGE_REFUSED with a code from :data:`REFUSALS`. Who may
ask (members only) and what a server holds are checked above this module; here every field is
bounded: a path of at most ``MAX_PATH`` characters, an offset below 2**56, a length of at least 1
(the server refuses one over ``Limits.max_range_bytes`` with "too-large", so the asker learns
the cap instead of seeing its stream cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from swarm.errors import ProtocolError
from swarm.proto.fields import Int, Str, header, meta
from swarm.proto.frame import DType, Flag, Frame, MsgType, encode_head
from swarm.proto.limits import Limits
from swarm.proto.messages import MAX_REASON, Message, register

MAX_PATH = 1024
MAX_OFFSET = 1 << 56
# "not-held": the server does not hold (verified) every byte asked; "too-large": over its
# max_range_bytes; "unknown-file": not a file of the model; "busy": it serves too many already
REFUSALS = ("not-held", "too-large", "unknown-file", "busy")


@register
@dataclass(frozen=True, slots=True)
class RangeRequest(Message):
    """Bytes [offset, offset + length) of ``file`` (a path of the model manifest)."""

    TYPE: ClassVar[MsgType] = MsgType.RANGE_REQUEST
    FRAME: ClassVar[str] = "session"
    req: int = header("session")
    file: str = meta("file", Str(MAX_PATH, min_len=1))
    offset: int = meta("offset", Int(0, MAX_OFFSET))
    length: int = meta("length", Int(1, MAX_OFFSET))


class _Bytes(Message):
    """Raw bytes as a frame's payload: dtype U8, shape (n,), 1 <= n <= max_range_chunk."""

    FRAME: ClassVar[str] = "tensor"

    @classmethod
    def check_frame(cls, frame: Frame, limits: Limits) -> None:
        super().check_frame(frame, limits)
        if frame.dtype is not DType.U8 or len(frame.shape) != 1:
            raise ProtocolError(f"RANGE_DATA field 'dtype': {frame.dtype.name}{list(frame.shape)}, expected U8 (n,)")
        if not 1 <= frame.shape[0] <= limits.max_range_chunk:
            raise ProtocolError(f"RANGE_DATA field 'shape': {frame.shape[0]} bytes outside "
                                f"1..{limits.max_range_chunk} (limit max_range_chunk)")  # fmt: skip


@register
@dataclass(frozen=True, slots=True)
class RangeData(_Bytes):
    """The next ``len(data)`` bytes of request ``req``, starting at ``offset`` of the file."""

    TYPE: ClassVar[MsgType] = MsgType.RANGE_DATA
    req: int = header("session")
    offset: int = meta("offset", Int(0, MAX_OFFSET))
    dtype: DType = header("dtype")
    shape: tuple[int, ...] = header("shape")
    data: bytes | memoryview = header("payload")  # a view: of the opened message, or the sender's buffer
    flags: int = header("flags", default=0)

    def __repr__(self) -> str:
        return f"RangeData(req={self.req}, offset={self.offset}, {len(self.data)}B, last={self.last})"

    @property
    def last(self) -> bool:
        return bool(self.flags & Flag.LAST)

    @classmethod
    def of(cls, req: int, offset: int, data: bytes | memoryview, last: bool) -> RangeData:
        return cls(req, offset, DType.U8, (len(data),), data, int(Flag.LAST) if last else 0)

    @classmethod
    def head(cls, req: int, offset: int, n: int, last: bool, limits: Limits) -> bytes:
        """The encoded RANGE_DATA of ``n`` bytes at ``offset`` up to its payload: followed by
        those bytes, it is ``encode_frame(RangeData.of(...).to_frame())`` (a member reads the
        bytes from disk straight into their place after it)."""
        frame = cls(req, offset, DType.U8, (n,), b"", int(Flag.LAST) if last else 0).to_frame()
        return encode_head(frame, n, limits)


@register
@dataclass(frozen=True, slots=True)
class RangeRefused(Message):
    TYPE: ClassVar[MsgType] = MsgType.RANGE_REFUSED
    FRAME: ClassVar[str] = "session"
    req: int = header("session")
    code: str = meta("code", Str(16, choices=REFUSALS))
    reason: str = meta("reason", Str(MAX_REASON), default="")


def data_frames(req: int, offset: int, data: bytes, limits: Limits) -> list[RangeData]:
    """``data`` (the bytes at ``offset``) as RANGE_DATA frames of at most max_range_chunk bytes."""
    step = limits.max_range_chunk
    n = len(data)
    return [RangeData.of(req, offset + i, data[i : i + step], i + step >= n) for i in range(0, n, step)]


class RangeReader:
    """The asker's side of one request, sans-IO: feed it each message that comes back; it checks
    that the pieces arrive in order, within the range asked, ending exactly at its end."""

    def __init__(self, req: RangeRequest) -> None:
        self.req = req
        self.pos = req.offset
        self.done = False

    def take(self, msg: Any) -> bytes | memoryview:
        """The bytes of one RANGE_DATA; ProtocolError for anything that is not the next piece
        (RANGE_REFUSED is the caller's to raise as a refusal before calling this)."""
        r = self.req
        if self.done:
            raise ProtocolError(f"RANGE_DATA for request {r.req} after its LAST piece")
        if not isinstance(msg, RangeData) or msg.req != r.req:
            raise ProtocolError(f"expected RANGE_DATA for request {r.req}, got {type(msg).__name__}")
        end = r.offset + r.length
        if msg.offset != self.pos or msg.offset + len(msg.data) > end:
            raise ProtocolError(f"RANGE_DATA for request {r.req}: bytes [{msg.offset}, {msg.offset + len(msg.data)}) "
                                f"where [{self.pos}, {end}) was due")  # fmt: skip
        self.pos += len(msg.data)
        if msg.last != (self.pos == end):
            raise ProtocolError(f"RANGE_DATA for request {r.req}: LAST at byte {self.pos} of [{r.offset}, {end})")
        self.done = msg.last
        return msg.data
