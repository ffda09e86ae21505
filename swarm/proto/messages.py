"""Typed messages carried in frames, each strictly validated against its own schema.

Every message class maps to one :class:`MsgType`, converts to a :class:`Frame` with ``to_frame()``
and back with ``from_frame(frame, limits)``; :func:`parse_message` dispatches on the frame's type.
``from_frame`` checks every header field the type uses (dtype, shape, session, seq), every
metadata key (required, optional, unknown ones refused) and its type and range, and raises
ProtocolError naming the message, the field and the limit. To add a type: add a ``MsgType``
member in ``frame.py`` and a class here decorated with ``@register``.

Header use per type: ``session`` is the generation session (0 for swarm-level messages); ``seq``
is the chunk id for CHUNK/RESULT/ERROR, the beat number for HEARTBEAT, the advert sequence for
ADVERT and the epoch for PLAN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from swarm.errors import ProtocolError
from swarm.proto.frame import DType, Frame, MsgType, decode_frame, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.signing import b64d, b64e

NONCE_BYTES = 32
PROOF_BYTES = 32
MAX_ID = 128  # peer IDs, swarm IDs
MAX_REASON = 256
CHUNK_MODES = ("prefill", "verify", "decode")
RESULT_KINDS = ("hidden", "logits", "tokens")


class Meta:
    """Reads one message's metadata; every accessor names the message and field in its error."""

    def __init__(self, frame: Frame, name: str) -> None:
        self._m = frame.meta
        self._name = name
        self._seen: set[str] = set()

    def fail(self, key: str, why: str) -> ProtocolError:
        return ProtocolError(f"{self._name} field '{key}': {why}")

    def _get(self, key: str, optional: bool) -> Any:
        self._seen.add(key)
        if key not in self._m:
            if optional:
                return None
            raise self.fail(key, "missing")
        return self._m[key]

    def get_int(
        self, key: str, lo: int, hi: int, *, optional: bool = False, default: int = 0
    ) -> int:
        v = self._get(key, optional)
        if v is None and optional:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"expected an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.fail(key, f"{v} outside {lo}..{hi}")
        return v

    def get_str(
        self, key: str, max_len: int, *, optional: bool = False, choices: tuple[str, ...] = ()
    ) -> str:
        v = self._get(key, optional)
        if v is None and optional:
            return ""
        if not isinstance(v, str):
            raise self.fail(key, f"expected a string, got {type(v).__name__}")
        if len(v) > max_len:
            raise self.fail(key, f"{len(v)} chars over the limit {max_len}")
        if choices and v not in choices:
            raise self.fail(key, f"{v[:32]!r} not one of {', '.join(choices)}")
        return v

    def get_bool(self, key: str) -> bool:
        v = self._get(key, False)
        if not isinstance(v, bool):
            raise self.fail(key, f"expected true/false, got {type(v).__name__}")
        return v

    def get_bytes(self, key: str, length: int, *, optional: bool = False) -> bytes | None:
        v = self._get(key, optional)
        if v is None and optional:
            return None
        try:
            return b64d(v, field=key, length=length)
        except ProtocolError as exc:
            raise self.fail(key, str(exc).split(": ", 1)[-1]) from None

    def get_raw(self, key: str, *, optional: bool = False) -> Any:
        return self._get(key, optional)

    def done(self) -> None:
        extra = sorted(set(self._m) - self._seen)
        if extra:
            raise self.fail(extra[0][:64], "unknown field")


class Message:
    TYPE: ClassVar[MsgType]

    def to_frame(self) -> Frame:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Message:  # pragma: no cover
        raise NotImplementedError

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


def expect(frame: Frame, *types: MsgType) -> None:
    if frame.msg_type not in types:
        names = "/".join(t.name for t in types)
        raise ProtocolError(f"expected a {names} message, got {frame.msg_type.name}")


def _no_tensor(frame: Frame, name: str) -> None:
    if frame.dtype is not DType.NONE:
        raise ProtocolError(
            f"{name} field 'dtype': {frame.dtype.name}, this message carries no tensor"
        )


def _no_session(frame: Frame, name: str) -> None:
    if frame.session:
        raise ProtocolError(f"{name} field 'session': {frame.session}, must be 0 for this message")


def _swarm_level(frame: Frame, name: str) -> Meta:
    _no_tensor(frame, name)
    _no_session(frame, name)
    return Meta(frame, name)


# ---------------------------------------------------------------- admission


@register
@dataclass(frozen=True, slots=True)
class AdmitHello(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_HELLO
    swarm_id: str
    peer_id: str
    nonce: bytes

    def to_frame(self) -> Frame:
        meta = {"swarm": self.swarm_id, "peer": self.peer_id, "nonce": b64e(self.nonce)}
        return Frame(self.TYPE, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> AdmitHello:
        m = _swarm_level(frame, "ADMIT_HELLO")
        out = cls(
            m.get_str("swarm", MAX_ID),
            m.get_str("peer", MAX_ID),
            m.get_bytes("nonce", NONCE_BYTES) or b"",
        )
        m.done()
        return out


@register
@dataclass(frozen=True, slots=True)
class AdmitChallenge(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_CHALLENGE
    peer_id: str
    nonce: bytes
    proof: bytes

    def __repr__(self) -> str:
        return f"AdmitChallenge(peer_id={self.peer_id!r})"

    def to_frame(self) -> Frame:
        meta = {"peer": self.peer_id, "nonce": b64e(self.nonce), "proof": b64e(self.proof)}
        return Frame(self.TYPE, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> AdmitChallenge:
        m = _swarm_level(frame, "ADMIT_CHALLENGE")
        out = cls(
            m.get_str("peer", MAX_ID),
            m.get_bytes("nonce", NONCE_BYTES) or b"",
            m.get_bytes("proof", PROOF_BYTES) or b"",
        )
        m.done()
        return out


@register
@dataclass(frozen=True, slots=True)
class AdmitResponse(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_RESPONSE
    proof: bytes

    def __repr__(self) -> str:
        return "AdmitResponse(proof=...)"

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, meta={"proof": b64e(self.proof)})

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> AdmitResponse:
        m = _swarm_level(frame, "ADMIT_RESPONSE")
        out = cls(m.get_bytes("proof", PROOF_BYTES) or b"")
        m.done()
        return out


@register
@dataclass(frozen=True, slots=True)
class AdmitResult(Message):
    TYPE: ClassVar[MsgType] = MsgType.ADMIT_RESULT
    ok: bool
    reason: str = ""

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, meta={"ok": self.ok, "reason": self.reason})

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> AdmitResult:
        m = _swarm_level(frame, "ADMIT_RESULT")
        out = cls(m.get_bool("ok"), m.get_str("reason", MAX_REASON))
        m.done()
        return out


# ---------------------------------------------------------------- control: adverts, heartbeats, plans


@register
@dataclass(frozen=True, slots=True)
class Advert(Message):
    """A peer's signed self-description. Sign/verify with ``swarm.proto.signed``.

    Integers only (signed canonical JSON): memory in bytes, times in microseconds. ``layer_us`` 0
    means not measured yet; ``rtt_us`` maps other peers' IDs to measured round trips.
    """

    TYPE: ClassVar[MsgType] = MsgType.ADVERT
    peer_id: str
    public_key: bytes
    swarm_id: str
    seq: int
    addrs: tuple[str, ...] = ()
    device_kind: str = "cpu"
    device_name: str = ""
    memory_bytes: int = 0
    layer_us: int = 0
    rtt_us: dict[str, int] = field(default_factory=dict)
    signature: bytes = b""

    def body(self) -> dict[str, Any]:
        """Everything that is signed (all but the signature)."""
        return {
            "peer": self.peer_id, "key": b64e(self.public_key), "swarm": self.swarm_id, "seq": self.seq,
            "addrs": list(self.addrs), "device": {"kind": self.device_kind, "name": self.device_name},
            "memory": self.memory_bytes, "layer_us": self.layer_us, "rtt_us": dict(self.rtt_us),
        }  # fmt: skip

    def to_frame(self) -> Frame:
        meta = self.body()
        meta["sig"] = b64e(self.signature)
        return Frame(self.TYPE, seq=self.seq, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Advert:
        name = "ADVERT"
        m = _swarm_level(frame, name)
        peer, key, swarm = (
            m.get_str("peer", MAX_ID),
            m.get_bytes("key", 32) or b"",
            m.get_str("swarm", MAX_ID),
        )
        seq = m.get_int("seq", 0, (1 << 63) - 1)
        if frame.seq != seq:
            raise m.fail("seq", f"{seq} disagrees with the header's {frame.seq}")
        addrs = m.get_raw("addrs")
        if not isinstance(addrs, list) or len(addrs) > limits.max_addresses:
            raise m.fail("addrs", f"expected a list of at most {limits.max_addresses} multiaddrs")
        if not all(isinstance(a, str) and a.startswith("/") and len(a) <= 256 for a in addrs):
            raise m.fail(
                "addrs", "every entry must be a multiaddr string (starting with '/', <= 256 chars)"
            )
        device = m.get_raw("device")
        if not isinstance(device, dict) or set(device) != {"kind", "name"}:
            raise m.fail("device", "expected {kind, name}")
        kind, dname = device["kind"], device["name"]
        if not (
            isinstance(kind, str)
            and isinstance(dname, str)
            and 0 < len(kind) <= 16
            and len(dname) <= 128
        ):
            raise m.fail("device", "kind (1..16 chars) and name (<= 128 chars) must be strings")
        memory = m.get_int("memory", 0, 1 << 56)
        layer_us = m.get_int("layer_us", 0, 10**9)
        rtts = m.get_raw("rtt_us")
        if not isinstance(rtts, dict) or len(rtts) > limits.max_peers:
            raise m.fail("rtt_us", f"expected an object of at most {limits.max_peers} peers")
        for p, v in rtts.items():
            if (
                len(p) > MAX_ID
                or isinstance(v, bool)
                or not isinstance(v, int)
                or not 0 <= v <= 10**9
            ):
                raise m.fail("rtt_us", f"entry {p[:64]!r}: expected microseconds 0..1e9")
        sig = m.get_bytes("sig", 64) or b""
        m.done()
        return cls(
            peer, key, swarm, seq, tuple(addrs), kind, dname, memory, layer_us, dict(rtts), sig
        )


@register
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    seq: int
    time_us: int  # the sender's clock, echoed back for RTT measurement

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, seq=self.seq, meta={"t": self.time_us})

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Heartbeat:
        m = _swarm_level(frame, "HEARTBEAT")
        out = cls(frame.seq, m.get_int("t", 0, (1 << 63) - 1))
        m.done()
        return out


@register
@dataclass(frozen=True, slots=True)
class Plan(Message):
    """One epoch's plan (its JSON is the planner's business: bounded here, not interpreted).
    Optionally signed: see ``swarm.proto.signed.sign_plan``."""

    TYPE: ClassVar[MsgType] = MsgType.PLAN
    epoch: int
    plan: dict[str, Any]
    signer: bytes | None = None
    signature: bytes | None = None

    def to_frame(self) -> Frame:
        meta: dict[str, Any] = {"epoch": self.epoch, "plan": self.plan}
        if self.signer is not None:
            meta["signer"] = b64e(self.signer)
        if self.signature is not None:
            meta["sig"] = b64e(self.signature)
        return Frame(self.TYPE, seq=self.epoch, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Plan:
        m = _swarm_level(frame, "PLAN")
        epoch = m.get_int("epoch", 0, (1 << 63) - 1)
        if frame.seq != epoch:
            raise m.fail("epoch", f"{epoch} disagrees with the header's {frame.seq}")
        plan = m.get_raw("plan")
        if not isinstance(plan, dict):
            raise m.fail("plan", "expected a JSON object")
        signer, sig = (
            m.get_bytes("signer", 32, optional=True),
            m.get_bytes("sig", 64, optional=True),
        )
        if (signer is None) != (sig is None):
            raise m.fail("sig", "signer and sig come together or not at all")
        m.done()
        return cls(epoch, plan, signer, sig)


# ---------------------------------------------------------------- activation path


def _tensor_fields(frame: Frame, name: str) -> None:
    if frame.dtype is DType.NONE:
        raise ProtocolError(f"{name} field 'dtype': NONE, this message carries a tensor")
    if frame.session == 0:
        raise ProtocolError(f"{name} field 'session': 0 is reserved for swarm-level messages")


def _tokens_axis(name: str, dtype: DType, shape: tuple[int, ...], limits: Limits) -> int:
    """T of a chunk: tokens are (T,) or (B, T) ints; hidden states (T, D) or (B, T, D) floats."""
    if dtype.is_int:
        if len(shape) not in (1, 2):
            raise ProtocolError(f"{name} field 'shape': token ids are (T,) or (B, T), got {shape}")
        t = shape[-1]
    else:
        if len(shape) not in (2, 3):
            raise ProtocolError(
                f"{name} field 'shape': hidden states are (T, D) or (B, T, D), got {shape}"
            )
        t = shape[-2]
        if shape[-1] == 0:
            raise ProtocolError(f"{name} field 'shape': hidden size 0")
    if len(shape) == (2 if dtype.is_int else 3) and not 1 <= shape[0] <= limits.max_batch:
        raise ProtocolError(
            f"{name} field 'shape': batch {shape[0]} outside 1..{limits.max_batch} (limit max_batch)"
        )
    if not 1 <= t <= limits.max_tokens_per_chunk:
        raise ProtocolError(
            f"{name} field 'shape': {t} tokens outside 1..{limits.max_tokens_per_chunk} (limit max_tokens_per_chunk)"
        )
    return t


@register
@dataclass(frozen=True, slots=True)
class Chunk(Message):
    """Activation / verify chunk: token ids (coordinator -> first stage) or hidden states (stage ->
    stage) for positions ``pos .. pos+T-1`` of ``session``. ``data`` is the raw tensor bytes."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    session: int
    chunk_id: int
    pos: int
    mode: str  # "prefill" | "verify" | "decode"
    dtype: DType
    shape: tuple[int, ...]
    data: bytes
    epoch: int = 0
    flags: int = 0

    def __repr__(self) -> str:
        return (
            f"Chunk(session={self.session}, chunk_id={self.chunk_id}, pos={self.pos}, mode={self.mode}, "
            f"{self.dtype.name}{list(self.shape)}, epoch={self.epoch})"
        )

    @property
    def tokens(self) -> int:
        return self.shape[-1] if self.dtype.is_int else self.shape[-2]

    def to_frame(self) -> Frame:
        meta = {"pos": self.pos, "mode": self.mode, "epoch": self.epoch}
        return Frame(
            self.TYPE,
            self.session,
            self.chunk_id,
            self.flags,
            self.dtype,
            self.shape,
            meta,
            self.data,
        )

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Chunk:
        name = "CHUNK"
        _tensor_fields(frame, name)
        t = _tokens_axis(name, frame.dtype, frame.shape, limits)
        m = Meta(frame, name)
        pos = m.get_int("pos", 0, limits.max_position - t)
        mode = m.get_str("mode", 16, choices=CHUNK_MODES)
        epoch = m.get_int("epoch", 0, (1 << 63) - 1)
        m.done()
        return cls(
            frame.session,
            frame.seq,
            pos,
            mode,
            frame.dtype,
            frame.shape,
            frame.payload,
            epoch,
            frame.flags,
        )


@register
@dataclass(frozen=True, slots=True)
class Result(Message):
    """What the tail returns to the coordinator for one chunk: hidden states, logits or top tokens."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    session: int
    chunk_id: int
    pos: int
    kind: str  # "hidden" | "logits" | "tokens"
    dtype: DType
    shape: tuple[int, ...]
    data: bytes
    epoch: int = 0

    def __repr__(self) -> str:
        return (
            f"Result(session={self.session}, chunk_id={self.chunk_id}, pos={self.pos}, kind={self.kind}, "
            f"{self.dtype.name}{list(self.shape)})"
        )

    def to_frame(self) -> Frame:
        meta = {"pos": self.pos, "kind": self.kind, "epoch": self.epoch}
        return Frame(
            self.TYPE, self.session, self.chunk_id, 0, self.dtype, self.shape, meta, self.data
        )

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Result:
        name = "RESULT"
        _tensor_fields(frame, name)
        m = Meta(frame, name)
        kind = m.get_str("kind", 16, choices=RESULT_KINDS)
        if (kind == "tokens") != frame.dtype.is_int:
            raise m.fail("kind", f"{kind} does not match dtype {frame.dtype.name}")
        t = _tokens_axis(name, frame.dtype, frame.shape, limits)
        pos = m.get_int("pos", 0, limits.max_position - t)
        epoch = m.get_int("epoch", 0, (1 << 63) - 1)
        m.done()
        return cls(
            frame.session, frame.seq, pos, kind, frame.dtype, frame.shape, frame.payload, epoch
        )


def _session_only(frame: Frame, name: str) -> Meta:
    _no_tensor(frame, name)
    if frame.session == 0:
        raise ProtocolError(f"{name} field 'session': 0 is reserved for swarm-level messages")
    return Meta(frame, name)


@register
@dataclass(frozen=True, slots=True)
class Rollback(Message):
    """Truncate ``session``'s KV cache to ``length`` positions (drop rejected drafts)."""

    TYPE: ClassVar[MsgType] = MsgType.ROLLBACK
    session: int
    length: int
    epoch: int = 0

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, self.session, 0, 0, meta={"len": self.length, "epoch": self.epoch})

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Rollback:
        m = _session_only(frame, "ROLLBACK")
        out = cls(
            frame.session,
            m.get_int("len", 0, limits.max_position),
            m.get_int("epoch", 0, (1 << 63) - 1),
        )
        m.done()
        return out


@register
@dataclass(frozen=True, slots=True)
class SessionEnd(Message):
    """The session is over: free its caches."""

    TYPE: ClassVar[MsgType] = MsgType.SESSION_END
    session: int

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, self.session)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> SessionEnd:
        m = _session_only(frame, "SESSION_END")
        m.done()
        return cls(frame.session)


@register
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A peer reports that it could not handle ``chunk_id`` of ``session`` (0 = not session-bound)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    session: int
    chunk_id: int
    code: str  # short machine-readable word, e.g. "bad_tensor", "overloaded", "no_session"
    message: str = ""

    def to_frame(self) -> Frame:
        return Frame(
            self.TYPE, self.session, self.chunk_id, meta={"code": self.code, "msg": self.message}
        )

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Error:
        name = "ERROR"
        _no_tensor(frame, name)
        m = Meta(frame, name)
        code = m.get_str("code", 32)
        if not code or not all(c.isascii() and (c.isalnum() or c in "_-") for c in code):
            raise m.fail("code", "expected 1..32 chars of [A-Za-z0-9_-]")
        out = cls(frame.session, frame.seq, code, m.get_str("msg", 1024))
        m.done()
        return out


MESSAGE_TYPES: dict[MsgType, type[Message]] = _REGISTRY
