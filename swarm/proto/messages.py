"""Typed messages carried in frames, each strictly validated against its own declared schema.

Every message class maps to one :class:`MsgType` and declares its fields once
(``swarm.proto.fields``): ``to_frame()`` and ``from_frame(frame, limits)`` are generated from that
declaration; :func:`parse_message` dispatches on the frame's type. Decoding checks the header
fields the type uses (tensor or not, session) and every metadata key (required, optional,
unknown ones refused) with its type and range, and raises ProtocolError naming the message, the
field and the limit. To add a type: add a ``MsgType`` member in ``frame.py`` and a class decorated
with ``@register``. Here are the swarm-level messages (admission, advert, heartbeat, plan) and
the activation path's (below); CONTROL's are in ``control.py``, tensors/1's in ``tensors.py``.

Header use per type: ``session`` is the generation session (0 for swarm-level messages); ``seq``
is the chunk id for CHUNK/RESULT/ERROR, the beat number for HEARTBEAT, the advert sequence for
ADVERT and the epoch for PLAN.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, overload

from swarm.errors import BadMessage, ProtocolError
from swarm.proto.fields import (
    B64,
    Addrs,
    Bool,
    Fields,
    Int,
    IntMap,
    Obj,
    Str,
    Word,
    header,
    header_values,
    meta,
    read_fields,
    wire_fields,
    write_fields,
)
from swarm.proto.frame import (
    DType,
    Frame,
    MsgType,
    canonical_bytes,
    decode_frame,
    encode_frame,
    payload_bytes,
)
from swarm.proto.limits import DEFAULT_LIMITS, Limits

NONCE_BYTES = 32
PROOF_BYTES = 32
SIG_BYTES = 64  # the Ed25519 signature a member answers a client's admission with
CLIENT_ROLE = "client"  # the one role an ADMIT_HELLO may name (absent: a member)
MAX_ID = 128  # peer IDs, swarm IDs
MAX_REASON = 256
I63 = (1 << 63) - 1
MAX_HELD_RANGES = 64  # layer ranges an advert says its peer holds
MAX_LAYER = 1 << 16
# an advert's fields from a newer version (Advert.extra): at most this many, named like ours, this
# many bytes of canonical JSON in all
MAX_ADVERT_EXTRA = 8
MAX_ADVERT_EXTRA_BYTES = 2048
_EXTRA_KEY = re.compile(r"[a-z][a-z0-9_]{0,31}")


class Message:
    """A message: its fields are declared (``swarm.proto.fields``); ``FRAME`` says how it uses
    the frame header: "swarm" (no tensor, session 0), "session" (no tensor, a session), "any" (no
    tensor, any session) or "tensor" (a tensor of a session)."""

    TYPE: ClassVar[MsgType]
    FRAME: ClassVar[str] = "swarm"

    def meta(self) -> dict[str, Any]:
        return write_fields(self)

    def to_frame(self) -> Frame:
        hdr = dict(header_values(self))
        if "payload" in hdr:
            hdr["payload"] = payload_bytes(hdr["payload"])  # a byte view stays one: copied once, when encoded
        return Frame(self.TYPE, meta=self.meta(), **hdr)

    @classmethod
    def check_frame(cls, frame: Frame, limits: Limits) -> None:
        """Header rules of this type, before its metadata is read (see FRAME)."""
        name = cls.TYPE.name
        if cls.FRAME == "tensor":
            if frame.dtype is DType.NONE:
                raise ProtocolError(f"{name} field 'dtype': NONE, this message carries a tensor")
        elif frame.dtype is not DType.NONE:
            raise ProtocolError(f"{name} field 'dtype': {frame.dtype.name}, this message carries no tensor")
        if cls.FRAME == "swarm" and frame.session:
            raise ProtocolError(f"{name} field 'session': {frame.session}, must be 0 for this message")
        if cls.FRAME in ("session", "tensor") and frame.session == 0:
            raise ProtocolError(f"{name} field 'session': 0 is reserved for swarm-level messages")

    def check(self, limits: Limits, fail: Any) -> None:
        """Rules across fields (``fail(key, why)`` makes the error); none by default."""

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Message:
        return cls._read(frame, limits)

    @classmethod
    def _read(cls, frame: Frame, limits: Limits) -> Message:
        cls.check_frame(frame, limits)
        src = Fields(frame.meta, cls.TYPE.name)
        hdr = {f.name: getattr(frame, f.name) for f in dataclasses.fields(Frame)}
        msg = cls(**read_fields(cls, src, limits, hdr))
        msg.check(limits, src.fail)
        return msg

    def encode(self, limits: Limits = DEFAULT_LIMITS) -> bytes:
        return encode_frame(self.to_frame(), limits)


_REGISTRY: dict[MsgType, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def register(cls: M) -> M:
    if cls.TYPE in _REGISTRY:
        raise RuntimeError(f"message type {cls.TYPE.name} registered twice")
    _REGISTRY[cls.TYPE] = cls
    return cls


def parse_message(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate a frame against its type's schema; ProtocolError (or FrameError) otherwise."""
    cls = _REGISTRY.get(frame.msg_type)
    if cls is None:
        raise ProtocolError(f"no parser for message type {frame.msg_type!r}")
    return cls.from_frame(frame, limits)


def decode_message(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """One whole frame's bytes -> its message."""
    return parse_message(decode_frame(data, limits), limits)


Msg = TypeVar("Msg", bound=Message)


def message_name(kind: Message | type[Message]) -> str:
    """How an error names a message (or a message class): its type, and a CONTROL op's name."""
    mtype, op = getattr(kind, "TYPE", None), getattr(kind, "OP", None)
    if mtype is None:
        return "any message"
    return f"{mtype.name} {op}" if op else mtype.name


def expect_message(frame: Frame, limits: Limits, expect: type[Msg], *, peer: str, where: str = "") -> Msg:
    """``frame`` from ``peer`` as a message of class ``expect`` (``Message``: any), or a
    BadMessage that names the peer, ``where`` it came (a protocol, a hop) and what came, and
    carries the frame's session and seq."""
    on = f" on {where}" if where else ""
    try:
        msg = parse_message(frame, limits)
    except ProtocolError as exc:
        raise BadMessage(f"peer {peer}{on}: {exc}", frame.session, frame.seq) from None
    if not isinstance(msg, expect):
        what = f"sent {message_name(msg)} where {message_name(expect)} was expected"
        raise BadMessage(f"peer {peer}{on} {what}", frame.session, frame.seq)
    return msg


class MessageIO:
    """Typed messages over a link or stream that carries frames: the one place (with the message
    classes' ``to_frame``/``parse_message`` above) where a message becomes a frame and back, so
    the code above a link (swarm/node/) sends and receives messages, never frames.

    A class mixes it in beside its own frame-level ``send(frame, timeout)`` and
    ``receive(timeout)`` (which relays and wire tests keep using) and says which ``peer`` it
    talks to and with which ``limits`` it decodes. No I/O here: each method is one await on the
    class's own frame methods."""

    peer: str
    limits: Limits
    protocol: str = ""  # where its messages come, for errors

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        raise NotImplementedError

    async def receive(self, timeout: float | None = None) -> Frame:
        raise NotImplementedError

    opens_into = False  # receive_view opens a message into the caller's buffer (a fast-path link does)

    async def receive_view(self, timeout: float | None = None, *, into: bytearray | None = None) -> Frame:
        """``receive``, its payload a view of the bytes that came where the class can give one
        (a fast-path link does); here a copy. ``into``: a buffer the caller owns and leaves alone
        until done with the frame, where a class that ``opens_into`` opens the message; here
        unused."""
        return await self.receive(timeout)

    async def send_message(self, msg: Message, timeout: float | None = None) -> None:
        """Send one message (encoded as its one frame; the wire bytes are ``msg.encode()``'s)."""
        await self.send(msg.to_frame(), timeout)

    @overload
    async def receive_message(self, timeout: float | None = None, *, view: bool = False,
                              into: bytearray | None = None) -> Message: ...  # fmt: skip

    @overload
    async def receive_message(self, timeout: float | None = None, *, expect: type[Msg], view: bool = False,
                              into: bytearray | None = None) -> Msg: ...  # fmt: skip

    async def receive_message(
        self, timeout: float | None = None, *, expect: type[Message] = Message, view: bool = False,
        into: bytearray | None = None,
    ) -> Message:
        """The next message, checked to be an ``expect`` (default: any message). A whole frame
        that is no valid message, or not an ``expect``, is a BadMessage naming the peer and what
        came (the stream is still sound); a broken stream raises what ``receive`` raises
        (FrameError, PeerLost), silence PeerTimeout. ``view``:
        its payload a view, not a copy, where the link can (``receive_view``: model bytes that
        are only hashed and written, swarm/node/compute/rangepipe.py)."""
        frame = await (self.receive_view(timeout, into=into) if view else self.receive(timeout))
        return expect_message(frame, self.limits, expect, peer=self.peer, where=self.protocol)

    @overload
    async def request_message(self, msg: Message, timeout: float | None = None) -> Message: ...

    @overload
    async def request_message(self, msg: Message, timeout: float | None = None, *, expect: type[Msg]) -> Msg: ...

    async def request_message(
        self, msg: Message, timeout: float | None = None, *, expect: type[Message] = Message
    ) -> Message:
        """Send ``msg`` and return the next message received (each wait bounded by ``timeout``)."""
        await self.send_message(msg, timeout)
        return await self.receive_message(timeout, expect=expect)


# ---------------------------------------------------------------- admission


@register
@dataclass(frozen=True, slots=True)
class AdmitHello(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_HELLO
    swarm_id: str = meta("swarm", Str(MAX_ID))
    peer_id: str = meta("peer", Str(MAX_ID))
    nonce: bytes = meta("nonce", B64(NONCE_BYTES))
    # "client": the initiator proves the client credential; absent (None) for a member, so a
    # member's HELLO is byte for byte what it was before roles existed
    role: str | None = meta("role", Str(16, choices=(CLIENT_ROLE,)), optional=True, default=None)


@register
@dataclass(frozen=True, slots=True)
class AdmitChallenge(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_CHALLENGE
    peer_id: str = meta("peer", Str(MAX_ID))
    nonce: bytes = meta("nonce", B64(NONCE_BYTES))
    proof: bytes | None = meta("proof", B64(PROOF_BYTES), optional=True, default=None)  # a MAC, to a member
    sig: bytes | None = meta("sig", B64(SIG_BYTES), optional=True, default=None)  # a signature, to a client

    def __repr__(self) -> str:
        return f"AdmitChallenge(peer_id={self.peer_id!r})"

    def check(self, limits: Limits, fail: Any) -> None:
        if (self.proof is None) == (self.sig is None):
            raise fail("proof", "expected exactly one of 'proof' (to a member) and 'sig' (to a client)")


@register
@dataclass(frozen=True, slots=True)
class AdmitResponse(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_RESPONSE
    proof: bytes = meta("proof", B64(PROOF_BYTES))

    def __repr__(self) -> str:
        return "AdmitResponse(proof=...)"


@register
@dataclass(frozen=True, slots=True)
class AdmitResult(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_RESULT
    ok: bool = meta("ok", Bool())
    reason: str = meta("reason", Str(MAX_REASON), default="")


# ---------------------------------------------------------------- control: adverts, heartbeats, plans


@register
@dataclass(frozen=True, slots=True)
class Advert(Message):
    """A peer's signed self-description. Sign/verify with ``swarm.proto.signed``.

    Integers only (signed canonical JSON): memory in bytes, times in microseconds. ``layer_us`` 0
    means not measured yet; ``rtt_us`` maps other peers' IDs to measured round trips.
    """

    TYPE: ClassVar[MsgType] = MsgType.ADVERT
    peer_id: str = meta("peer", Str(MAX_ID))
    public_key: bytes = meta("key", B64(32))
    swarm_id: str = meta("swarm", Str(MAX_ID))
    seq: int = meta("seq", Int(0, I63), header="seq")
    addrs: tuple[str, ...] = meta("addrs", Addrs(lambda lim: lim.max_addresses), default=())
    device_kind: str = meta("kind", Str(16, min_len=1), group="device", default="cpu")
    device_name: str = meta("name", Str(128), group="device", default="")
    memory_bytes: int = meta("memory", Int(0, 1 << 56), default=0)
    layer_us: int = meta("layer_us", Int(0, 10**9), default=0)
    rtt_us: dict[str, int] = meta(
        "rtt_us", IntMap(lambda lim: lim.max_peers, MAX_ID, 0, 10**9, unit="microseconds"), default_factory=dict
    )
    signature: bytes = meta("sig", B64(64), default=b"")
    # the draft model this peer runs when it coordinates (all three, or none: absent from the
    # signed body then): its name, the bytes it takes there, its time per drafted token
    draft_name: str | None = meta("draft", Str(128, min_len=1), optional=True, default=None)
    draft_bytes: int | None = meta("draft_bytes", Int(0, 1 << 56), optional=True, default=None)
    draft_us: int | None = meta("draft_us", Int(0, 10**9), optional=True, default=None)
    # the model's layers this peer holds verified and serves to members on /shard-swarm/tensors/1
    # (swarm.proto.tensors), as ranges {"start": end}, and whether it holds the head; absent: none
    held: dict[str, int] | None = meta(
        "held", IntMap(MAX_HELD_RANGES, 7, 1, MAX_LAYER, what="layer ranges", unit="an end layer"),
        optional=True, default=None,
    )  # fmt: skip
    held_head: bool | None = meta("held_head", Bool(), optional=True, default=None)
    # bytes of disk left for model bytes it does not hold yet (its --disk budget less what its cache
    # holds), so a plan never gives it a block it cannot store; absent: unbounded
    disk: int | None = meta("disk", Int(0, 1 << 56), optional=True, default=None)
    # the sessions whose KV cache its stage reserves inside its memory (its `join --sessions`; at most
    # the stage worker's 64, node/ring/capacity.MAX_SESSIONS), so the leader plans its block with
    # that count; absent: the leader's own count (planner Peer.sessions)
    sessions: int | None = meta("sessions", Int(1, 64), optional=True, default=None)
    # the width in bytes of the values it serves in (4: fp32), so the leader states a quantized
    # layer's packed integers, which do not widen, at that width (planner Peer.dtype_bytes); absent:
    # the planner's 2-byte unit, which budgets them at twice their size on an fp32 peer
    dtype_bytes: int | None = meta("dtype_bytes", Int(1, 8), optional=True, default=None)
    # top-level fields this version does not know (a newer peer's): signed with the rest and passed
    # on as they came, never interpreted, so a swarm can upgrade one member at a time (bounded:
    # MAX_ADVERT_EXTRA keys named like ours, MAX_ADVERT_EXTRA_BYTES of JSON)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Message:
        known = {w.key if w.group is None else w.group for _, w, _ in wire_fields(cls)}
        extra = {k: v for k, v in frame.meta.items() if k not in known}
        if not extra:
            return cls._read(frame, limits)
        name = cls.TYPE.name
        if len(extra) > MAX_ADVERT_EXTRA:
            raise ProtocolError(f"{name}: {len(extra)} fields this version does not know, over {MAX_ADVERT_EXTRA}")
        for k in extra:
            if not _EXTRA_KEY.fullmatch(k):
                raise ProtocolError(f"{name} field {k[:64]!r}: unknown, and not named as a field can be")
        if len(canonical_bytes(extra)) > MAX_ADVERT_EXTRA_BYTES:
            raise ProtocolError(f"{name}: its unknown fields ({', '.join(sorted(extra))}) hold over "
                                f"{MAX_ADVERT_EXTRA_BYTES} bytes")  # fmt: skip
        rest = dataclasses.replace(frame, meta={k: v for k, v in frame.meta.items() if k in known})
        msg = cls._read(rest, limits)
        return dataclasses.replace(msg, extra=extra)  # type: ignore[type-var]

    def meta(self) -> dict[str, Any]:
        return {**write_fields(self), **self.extra}

    def check(self, limits: Limits, fail: Any) -> None:
        if len({self.draft_name is None, self.draft_bytes is None, self.draft_us is None}) > 1:
            raise fail("draft", "draft, draft_bytes and draft_us come together or not at all")
        for k, end in (self.held or {}).items():
            if not (k.isascii() and k.isdigit() and str(int(k)) == k and int(k) < end):
                raise fail("held", f"entry {k[:8]!r}: expected a start layer below its end {end}")
        if self.dtype_bytes is not None and self.dtype_bytes not in (1, 2, 4, 8):
            raise fail("dtype_bytes", f"{self.dtype_bytes}: a value is 1, 2, 4 or 8 bytes wide")

    def held_layers(self) -> list[int]:
        """Every layer of :attr:`held` (bounded by MAX_LAYER and MAX_HELD_RANGES)."""
        return sorted({i for k, end in (self.held or {}).items() for i in range(int(k), end)})

    def body(self) -> dict[str, Any]:
        """Everything that is signed (all but the signature; a newer peer's fields too)."""
        return {**write_fields(self, skip=frozenset({"sig"})), **self.extra}


@register
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    seq: int = header("seq")
    time_us: int = meta("t", Int(0, I63))  # the sender's clock, echoed back for RTT measurement


@register
@dataclass(frozen=True, slots=True)
class Plan(Message):
    """One epoch's plan (its JSON is the planner's business: bounded here, not interpreted).
    Optionally signed: see ``swarm.proto.signed.sign_plan``."""

    TYPE: ClassVar[MsgType] = MsgType.PLAN
    epoch: int = meta("epoch", Int(0, I63), header="seq")
    plan: dict[str, Any] = meta("plan", Obj())
    signer: bytes | None = meta("signer", B64(32), optional=True, default=None)
    signature: bytes | None = meta("sig", B64(64), optional=True, default=None)

    def check(self, limits: Limits, fail: Any) -> None:
        if (self.signer is None) != (self.signature is None):
            raise fail("sig", "signer and sig come together or not at all")


# ---------------------------------------------------------------- the activation path
# The activation path's messages: chunks, results, rollbacks, session ends and errors.
#
# A CHUNK carries token ids (coordinator -> first stage) or hidden states (stage -> stage) for
# positions ``pos .. pos+T-1`` of one session; the tail answers with a RESULT. Both carry their
# tensor as the frame's payload: token ids are (T,) or (B, T) ints, hidden states (T, D) or
# (B, T, D) floats (bf16 as its int16 bit pattern), bounded by :class:`~swarm.proto.limits.Limits`
# (tokens per chunk, batch, positions). Turning tensors into these messages and back, with the
# checks a peer's bytes need (dtype, hidden size, finiteness), is ``swarm.node.ring.codec``.
#
# Header use: ``session`` is the generation session (never 0), ``seq`` the chunk id, ``flags``
# the frame flags; ERROR may be sent about no session (0).

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


def __getattr__(name: str) -> Any:
    """``MESSAGE_TYPES``: every registered type (the registry is complete once ``swarm.proto``
    is imported, which importing this module always does first)."""
    if name == "MESSAGE_TYPES":
        return dict(_REGISTRY)
    raise AttributeError(name)
