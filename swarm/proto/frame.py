"""Binary frames: a fixed header, shape dims, JSON metadata, raw tensor bytes.

Theory of operation
-------------------
A frame on the wire is::

    header   32 bytes, little-endian (struct ``<2sBBBBBBQQII``)
             magic b"SW" | version u8 | msg type u8 | flags u8 | dtype u8 | ndim u8 | reserved u8 (0)
             | session u64 | seq u64 | meta_len u32 | payload_len u32
    dims     ndim x u32 (little-endian), the tensor shape
    meta     meta_len bytes of UTF-8 JSON: one object (absent when meta_len == 0, meaning {})
    payload  payload_len raw bytes: a C-contiguous little-endian tensor (bf16 travels as its int16
             bit pattern) or nothing when dtype is NONE

The header is validated the moment its 32 bytes have arrived: magic, version, type, flags, dtype,
the reserved byte and every announced length against :class:`Limits`, so an oversized or bogus
frame is refused before a single byte of its body is buffered. Then the dims are checked (each
dim <= max_dim, product <= max_elements, product x itemsize == payload_len) and the metadata is
parsed strictly (``decode_meta``, below: UTF-8, one object, no duplicate keys, no NaN/Infinity, bounded depth,
string and list lengths, 64-bit integers). What a message type requires of its metadata is
checked one layer up (fields.py and each message's declaration).

:class:`FrameDecoder` is sans-IO (in the manner of h11): ``feed(bytes)`` returns the frames that
are complete so far and keeps the rest. Once it has raised, it stays broken and raises again:
a stream that broke the protocol is never resynchronised.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import FrameError
from swarm.proto.limits import DEFAULT_LIMITS, WIRE_VERSION, Limits
from swarm.strictjson import canonical, unique_keys

MAGIC = b"SW"
HEADER = struct.Struct("<2sBBBBBBQQII")
HEADER_SIZE = HEADER.size  # 32
_DIM = struct.Struct("<I")
_U64_MAX = (1 << 64) - 1


class DType(enum.IntEnum):
    """Element type of a frame's payload. Values are wire codes; never renumber."""

    NONE = 0  # no tensor: ndim 0, empty payload
    BF16 = 1  # carried as the int16 bit pattern
    FP16 = 2
    FP32 = 3
    INT32 = 4
    INT64 = 5
    U8 = 6  # raw bytes (a model file's byte range, /shard-swarm/tensors/1): never an activation

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.BF16, DType.FP16, DType.FP32)

    @property
    def is_int(self) -> bool:
        return self in (DType.INT32, DType.INT64)


_ITEMSIZE = {
    DType.NONE: 0,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP32: 4,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.U8: 1,
}


class MsgType(enum.IntEnum):
    """Message type codes. Values are wire codes; never renumber. Add a member and a message
    class in ``messages.py`` to add a type."""

    ADMIT_HELLO = 0x01
    ADMIT_CHALLENGE = 0x02
    ADMIT_RESPONSE = 0x03
    ADMIT_RESULT = 0x04
    ADVERT = 0x10
    HEARTBEAT = 0x11
    PLAN = 0x12
    CONTROL = 0x13  # ring set-up, generation requests, status (swarm.proto.control)
    CHUNK = 0x20  # activation / verify chunk: tokens or hidden states
    RESULT = 0x21  # what the tail returns for a chunk
    ROLLBACK = 0x22
    SESSION_END = 0x23
    ERROR = 0x2F
    RANGE_REQUEST = 0x30  # a model file's byte range asked of a member (swarm.proto.tensors)
    RANGE_DATA = 0x31
    RANGE_REFUSED = 0x32


class Flag(enum.IntFlag):
    """Header flag bits; any bit not named here is refused."""

    NONE = 0
    LAST = 0x01  # the last frame of a logical sequence (e.g. final prefill chunk)
    URGENT = 0x02  # hint: process before queued chunks (rollbacks, cancels)


KNOWN_FLAGS = int(Flag.LAST | Flag.URGENT)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded (or to-be-encoded) frame. ``payload`` is raw tensor bytes, ``meta`` a JSON object."""

    msg_type: MsgType
    session: int = 0
    seq: int = 0
    flags: int = 0
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

    def __repr__(self) -> str:  # never dump payload bytes into logs
        return (
            f"Frame({self.msg_type.name}, session={self.session}, seq={self.seq}, flags={self.flags}, "
            f"dtype={self.dtype.name}, shape={self.shape}, meta_keys={sorted(self.meta)}, "
            f"payload={len(self.payload)}B)"
        )


# ---------------------------------------------------------------- validation shared by both ways


def _check_shape(dtype: DType, shape: tuple[int, ...], payload_len: int, limits: Limits) -> None:
    if dtype is DType.NONE:
        if shape:
            raise FrameError(
                f"frame field 'ndim': {len(shape)} dims given with dtype NONE (must be 0)"
            )
        if payload_len:
            raise FrameError(
                f"frame field 'payload_len': {payload_len} bytes with dtype NONE (must be 0)"
            )
        return
    if not 1 <= len(shape) <= limits.max_ndim:
        raise FrameError(
            f"frame field 'ndim': {len(shape)} outside 1..{limits.max_ndim} (limit max_ndim)"
        )
    elements = 1
    for i, d in enumerate(shape):
        if not 0 <= d <= limits.max_dim:
            raise FrameError(
                f"frame field 'shape[{i}]': {d} outside 0..{limits.max_dim} (limit max_dim)"
            )
        elements *= d
    if elements > limits.max_elements:
        raise FrameError(
            f"frame field 'shape': {elements} elements over the limit max_elements={limits.max_elements}"
        )
    if elements * dtype.itemsize != payload_len:
        raise FrameError(
            f"frame field 'payload_len': {payload_len} bytes but shape {shape} x {dtype.name} "
            f"itemsize {dtype.itemsize} = {elements * dtype.itemsize}"
        )


# ---------------------------------------------------------------- encoding


def payload_bytes(payload: Any) -> bytes | memoryview:
    """``payload`` as bytes, or as itself if it is a flat byte view already (joined into the
    encoded frame: one copy, not two); anything else (a tensor's buffer, a bytearray) copied."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, memoryview) and payload.itemsize == 1 and payload.ndim == 1 and payload.c_contiguous:
        return payload
    return bytes(payload)


def encode_frame(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Serialise a frame, applying the same caps a receiver will (we never send what is refused)."""
    payload = payload_bytes(frame.payload)
    return b"".join((encode_head(frame, len(payload), limits), payload))


def encode_head(frame: Frame, payload_len: int, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The encoded frame up to its payload (header, dims, metadata), for a payload of
    ``payload_len`` bytes that the caller places right after it (``frame.payload`` is not read):
    a sender that reads the payload straight into its place copies it no more. The same caps
    as :func:`encode_frame`."""
    try:
        msg_type = MsgType(frame.msg_type)
        dtype = DType(frame.dtype)
    except ValueError as exc:
        raise FrameError(f"cannot encode frame: {exc}") from None
    if frame.flags & ~KNOWN_FLAGS or frame.flags < 0:
        raise FrameError(f"frame field 'flags': unknown bits in {frame.flags:#x}")
    for name, v in (("session", frame.session), ("seq", frame.seq)):
        if not 0 <= v <= _U64_MAX:
            raise FrameError(f"frame field '{name}': {v} outside the unsigned 64-bit range")
    shape = tuple(int(d) for d in frame.shape)
    _check_shape(dtype, shape, payload_len, limits)
    meta = encode_meta(frame.meta, limits)
    total = HEADER_SIZE + 4 * len(shape) + len(meta) + payload_len
    if total > limits.max_frame_bytes:
        raise FrameError(f"frame of {total} bytes over max_frame_bytes={limits.max_frame_bytes}")
    header = HEADER.pack(
        MAGIC, WIRE_VERSION, int(msg_type), frame.flags, int(dtype), len(shape), 0,
        frame.session, frame.seq, len(meta), payload_len,
    )  # fmt: skip
    dims = b"".join(_DIM.pack(d) for d in shape)
    return b"".join((header, dims, meta))


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class _Header:
    msg_type: MsgType
    flags: int
    dtype: DType
    ndim: int
    session: int
    seq: int
    meta_len: int
    payload_len: int

    @property
    def body_len(self) -> int:
        return 4 * self.ndim + self.meta_len + self.payload_len


def _parse_header(raw: bytes | bytearray | memoryview, limits: Limits) -> _Header:
    magic, version, mtype, flags, dtype, ndim, reserved, session, seq, meta_len, payload_len = (
        HEADER.unpack(raw)
    )
    if magic != MAGIC:
        raise FrameError(
            f"frame field 'magic': {bytes(magic)!r}, expected {MAGIC!r} (not a shard-swarm stream?)"
        )
    if version != WIRE_VERSION:
        raise FrameError(f"frame field 'version': {version}, this peer speaks only {WIRE_VERSION}")
    try:
        msg_type = MsgType(mtype)
    except ValueError:
        raise FrameError(f"frame field 'type': unknown message type {mtype:#04x}") from None
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"frame field 'flags': unknown bits in {flags:#04x}")
    try:
        dt = DType(dtype)
    except ValueError:
        raise FrameError(f"frame field 'dtype': unknown dtype code {dtype}") from None
    if reserved:
        raise FrameError(f"frame field 'reserved': {reserved}, must be 0")
    if ndim > limits.max_ndim:
        raise FrameError(f"frame field 'ndim': {ndim} over max_ndim={limits.max_ndim}")
    if meta_len > limits.max_meta_bytes:
        raise FrameError(
            f"frame field 'meta_len': {meta_len} over max_meta_bytes={limits.max_meta_bytes}"
        )
    total = HEADER_SIZE + 4 * ndim + meta_len + payload_len
    if total > limits.max_frame_bytes:
        raise FrameError(
            f"frame field 'payload_len': frame of {total} bytes over max_frame_bytes={limits.max_frame_bytes}"
        )
    if dt is DType.NONE and (ndim or payload_len):
        raise FrameError(
            f"frame field 'dtype': NONE with ndim={ndim}, payload_len={payload_len} (both must be 0)"
        )
    if dt is not DType.NONE and ndim == 0:
        raise FrameError(
            f"frame field 'ndim': 0 with dtype {dt.name} (a tensor needs at least one dim)"
        )
    return _Header(msg_type, flags, dt, ndim, session, seq, meta_len, payload_len)


def _build_frame(h: _Header, body: bytes | bytearray | memoryview, limits: Limits, *, view: bool = False) -> Frame:
    shape = tuple(_DIM.unpack_from(body, 4 * i)[0] for i in range(h.ndim))
    _check_shape(h.dtype, shape, h.payload_len, limits)
    off = 4 * h.ndim
    meta = decode_meta(bytes(body[off : off + h.meta_len]), limits)
    off += h.meta_len
    payload: Any = body[off : off + h.payload_len] if view else bytes(body[off : off + h.payload_len])
    return Frame(h.msg_type, h.session, h.seq, h.flags, h.dtype, shape, meta, payload)


class FrameDecoder:
    """Incremental, sans-IO frame decoder: ``feed(data) -> [Frame, ...]``.

    Holds at most one partial frame (bounded by ``limits.max_frame_bytes``). After a FrameError it
    is closed: every further ``feed`` raises the same error.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._header: _Header | None = None
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete (0 at a frame boundary)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise FrameError(f"decoder closed after an earlier error: {self._error}")
        self._buf += data
        frames: list[Frame] = []
        try:
            while True:
                if self._header is None:
                    if len(self._buf) < HEADER_SIZE:
                        break
                    self._header = _parse_header(bytes(self._buf[:HEADER_SIZE]), self.limits)
                need = HEADER_SIZE + self._header.body_len
                if len(self._buf) < need:
                    break
                # released before the buffer is resized, even when _build_frame raises
                with memoryview(self._buf) as view, view[HEADER_SIZE:need] as body:
                    frame = _build_frame(self._header, body, self.limits)
                del self._buf[:need]
                self._header = None
                frames.append(frame)
        except FrameError as exc:
            self._error = exc
            self._buf.clear()
            raise
        return frames

    def eof(self) -> None:
        """Call when the stream ends: raises FrameError if it ended inside a frame."""
        if self._error is None and self._buf:
            n = len(self._buf)
            self._buf.clear()
            self._error = FrameError(
                f"stream ended inside a frame ({n} bytes of an incomplete frame)"
            )
            raise self._error


def decode_frame(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS, *, view: bool = False) -> Frame:
    """Decode exactly one whole frame (no bytes missing, none left over). ``view``: the payload
    is a memoryview of ``data``, not a copy: for a receiver that only hashes and writes it
    (model bytes, a MiB a frame), and that leaves ``data`` unchanged until then (bytes, or a
    view of a buffer it owns)."""
    n = len(data)
    h = _parse_header(data[:HEADER_SIZE], limits) if n >= HEADER_SIZE else None
    if h is None or n != HEADER_SIZE + h.body_len:
        frames, trailing = (0, n) if h is None or n < HEADER_SIZE + h.body_len else (1, n - HEADER_SIZE - h.body_len)
        raise FrameError(f"expected exactly one frame, got {frames} and {trailing} trailing bytes of {n}")
    body = memoryview(data)[HEADER_SIZE:]
    return _build_frame(h, body, limits, view=view)


# -- the metadata block ---------------------------------------------------------------------
# One bounded JSON object, canonical bytes both ways. Decoding refuses anything but one UTF-8 JSON
# object within the Limits: no duplicate keys, no NaN/Infinity, bounded depth, string and
# container sizes, integers within 64 bits, no lone surrogates (which no peer may pass on: they
# cannot be encoded again). Encoding applies the same caps, so this node never sends what a
# receiver refuses.

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def _flat_ok(value: dict[str, Any], limits: Limits) -> bool:
    """Fast path for the hot-path case: one flat object of small ints, strings, bools, nulls."""
    if len(value) > limits.max_list:
        return False
    for k, v in value.items():
        t = type(v)
        if len(k) > limits.max_string:
            return False
        if t is int:
            if not _INT_MIN <= v <= _INT_MAX:
                return False
        elif t is str:
            if len(v) > limits.max_string:
                return False
        elif not (v is None or t is bool):
            return False
    return True


def _check_json_value(value: Any, limits: Limits) -> None:
    """Walk a parsed JSON value iteratively: depth, string/list lengths, ints, finite floats."""
    if type(value) is dict and _flat_ok(value, limits):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limits.max_json_depth:
                raise FrameError(
                    f"frame meta: nesting deeper than max_json_depth={limits.max_json_depth}"
                )
            if len(v) > limits.max_list:
                raise FrameError(
                    f"frame meta: a container of {len(v)} items over max_list={limits.max_list}"
                )
            if isinstance(v, dict):
                for k, item in v.items():
                    if len(k) > limits.max_string:
                        raise FrameError(
                            f"frame meta: a key longer than max_string={limits.max_string}"
                        )
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)
        elif isinstance(v, str):
            if len(v) > limits.max_string:
                raise FrameError(
                    f"frame meta: a string of {len(v)} chars over max_string={limits.max_string}"
                )
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, int):
            if not _INT_MIN <= v <= _INT_MAX:
                raise FrameError("frame meta: an integer outside the signed 64-bit range")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise FrameError("frame meta: a non-finite number")
        else:  # pragma: no cover - json never produces other types
            raise FrameError(f"frame meta: unsupported value type {type(v).__name__}")


def canonical_bytes(obj: Any) -> bytes:
    """The project's one canonical JSON encoding (``swarm.strictjson.canonical``): frame
    metadata, and what adverts and plans are signed over (signing.canonical_json)."""
    return canonical(obj)


_pairs_no_dups = unique_keys(lambda msg: FrameError(f"frame meta: {msg}"))


def _reject_constant(name: str) -> Any:
    raise FrameError(f"frame meta: {name} is not allowed")


def encode_meta(meta: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Canonical compact JSON for a metadata object (sorted keys, UTF-8); b"" for an empty one."""
    if not isinstance(meta, dict):
        raise FrameError(f"frame meta must be a dict, got {type(meta).__name__}")
    if not meta:
        return b""
    _check_json_value(meta, limits)
    try:
        data = canonical_bytes(meta)
    except UnicodeEncodeError as exc:  # a lone surrogate (only a \uD800-style escape makes one)
        raise FrameError(f"frame meta: a string with a lone surrogate at char {exc.start}") from None
    except (TypeError, ValueError) as exc:
        raise FrameError(f"frame meta is not JSON-serialisable: {exc}") from None
    if len(data) > limits.max_meta_bytes:
        raise FrameError(
            f"frame meta: {len(data)} bytes over max_meta_bytes={limits.max_meta_bytes}"
        )
    return data


def decode_meta(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Strictly parse a metadata block; raises FrameError for anything but one bounded JSON object."""
    if not raw:
        return {}
    if len(raw) > limits.max_meta_bytes:
        raise FrameError(
            f"frame meta: {len(raw)} bytes over max_meta_bytes={limits.max_meta_bytes}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"frame meta: not UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(text, object_pairs_hook=_pairs_no_dups, parse_constant=_reject_constant)
    except FrameError:
        raise
    except RecursionError:
        raise FrameError(
            f"frame meta: nesting deeper than max_json_depth={limits.max_json_depth}"
        ) from None
    except ValueError as exc:  # JSONDecodeError, int digit limits
        raise FrameError(f"frame meta: invalid JSON ({str(exc)[:120]})") from None
    if not isinstance(value, dict):
        raise FrameError(f"frame meta: must be a JSON object, got {type(value).__name__}")
    _check_json_value(value, limits)
    if "\\u" in text:  # only an escape can smuggle in a lone surrogate, which no peer may re-send
        _check_no_surrogates(value)
    return value


def _check_no_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise FrameError(f"frame meta: a string with a lone surrogate at char {exc.start}") from None
