"""CONTROL: the swarm's small requests and replies, one typed message per op.

On the wire a CONTROL frame is one envelope: metadata ``{"op": word, "body": {...}}`` and, for the
ops that carry token ids (``gen``, ``tokens``), an INT32 (T,) tensor (token lists can be long,
and JSON lists are capped at ``max_list`` entries). Here every op is its own class, its body's
fields declared once with their bounds (``swarm.proto.fields``): decoding a frame gives the op's
class or a ProtocolError naming ``CONTROL <op> field '<key>'``.

Ops, by protocol (who may send each request is ``swarm.node.dispatch``'s dispatch table):

- ring set-up (``/shard-swarm/ring/1``): a PLAN message -> :class:`Loaded`; :class:`Connect` ->
  :class:`Linked`; :class:`Serve` -> :class:`Ack`; :class:`Current` -> the serving PLAN or
  :class:`NoPlan`; :class:`Ended`, :class:`Leaving`, :class:`Leave`, :class:`Fault`, :class:`BadBytes` ->
  :class:`Ack`.
- activation streams (``/shard-swarm/act/1``): :class:`Hop` opens one; :class:`Probe` opens a
  short one whose pings the other end echoes.
- generation (``/shard-swarm/gen/1``): :class:`Gen` (the one generation request type) ->
  :class:`Progress`* (a long prefill), :class:`Tokens`* and :class:`Notice`* -> :class:`Done` (the
  receipt); a prompt or receipt longer than one frame comes after :class:`Part` frames (parts.py); :class:`Status` ->
  :class:`StatusReply`.
- any: :class:`Fail` answers a request that could not be served; its ``code`` maps to one error
  type both ways (:func:`fail_of`, :meth:`Fail.error`), so errors stay typed end to end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from swarm.errors import (
    BadRequest,
    Busy,
    CannotServe,
    ContextTooLong,
    Forbidden,
    PeerError,
    PlanningError,
    ProtocolError,
    RequestRefused,
    SwarmError,
    UsageError,
)
from swarm.proto import fields as _fields
from swarm.proto.fields import (
    B64,
    Bool,
    Fields,
    Float,
    Int,
    Obj,
    Str,
    StrMap,
    Word,
    meta,
    read_fields,
    write_fields,
)
from swarm.proto.frame import DType, Frame, MsgType
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import I63, Message, Plan, register

IDS_PER_FRAME = 8192  # token ids in one CONTROL frame (32 KiB): a longer list travels in PART frames first
MAX_PROMPT_IDS = 1 << 20  # token ids in one assembled message (a prompt, a receipt): swarm.proto.parts
TEXT_PER_FRAME = 2048  # characters of prompt text in one frame (a longer text travels in parts too)
EPOCH_MAX = 1 << 62  # the one bound on an epoch number, everywhere it is read
MAX_PEER_ID = 128
MAX_HOPS = 64

# the bounds of a generation request (Gen): one set, checked once where a request is made or read
MAX_NEW_TOKENS = 4096
MAX_TEXT = 4 * 1024 * 1024  # characters of prompt text, assembled from its parts
MAX_TEMPERATURE = 2.0  # OpenAI's bound; 0 is greedy
MAX_TOP_K = 1 << 20
MAX_DEPTH = 4  # verify chunks in flight at most
MAX_DRAFT_K = 32
MAX_WAIT_S = 600.0
# what a request may ask for (swarm.node.compute.drafting): prompt lookup, nothing, the coordinator's draft
# model (by "model" or its name when it is derived from the model), or a choice by measured cost
DRAFTS = ("ngram", "none", "model", "auto", "self", "int8", "int4")


class Control(Message):
    """Base of every CONTROL op (see the module docstring)."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    OP: ClassVar[str]
    BODY: ClassVar[str | None] = None  # a field that is the whole body (a receipt, a status)

    def body(self) -> dict[str, Any]:
        if self.BODY is not None:
            return dict(getattr(self, self.BODY))
        return write_fields(self)

    def to_frame(self) -> Frame:
        meta = {"op": self.OP, "body": self.body()}
        ids: tuple[int, ...] = getattr(self, "ids", ())
        if ids:
            payload = b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids)
            return Frame(self.TYPE, dtype=DType.INT32, shape=(len(ids),), meta=meta, payload=payload)
        return Frame(self.TYPE, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Control:
        if frame.session:
            raise ProtocolError(f"CONTROL field 'session': {frame.session}, must be 0 for this message")
        env = Fields(frame.meta, "CONTROL")
        op = Str(16, choices=tuple(OPS)).read(frame.meta.get("op"), lambda why: env.fail("op", why), limits)
        body = Obj().read(frame.meta.get("body"), lambda why: env.fail("body", why), limits)
        env.seen |= {"op", "body"}
        env.done()
        op_cls = OPS[op]
        ids = _ids(frame, op_cls)
        if op_cls.BODY is not None:
            return op_cls(**{op_cls.BODY: body}, **({"ids": ids} if ids else {}))
        values = read_fields(op_cls, Fields(body, f"CONTROL {op}"), limits)
        if ids:
            values["ids"] = ids
        return op_cls(**values)


def _ids(frame: Frame, op_cls: type[Control]) -> tuple[int, ...]:
    if frame.dtype is DType.NONE:
        return ()
    if frame.dtype is not DType.INT32 or "ids" not in {f.name for f in dataclasses.fields(op_cls)}:  # type: ignore[arg-type]
        raise ProtocolError(f"CONTROL {op_cls.OP} field 'dtype': {frame.dtype.name}, expected INT32 token ids or none")
    if len(frame.shape) != 1 or frame.shape[0] > IDS_PER_FRAME:
        raise ProtocolError(f"CONTROL field 'shape': token ids are (T,) with T <= {IDS_PER_FRAME}, got {frame.shape}")
    raw = frame.payload
    return tuple(int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4))


OPS: dict[str, type[Control]] = {}
C = TypeVar("C", bound=type[Control])


def op(cls: C) -> C:
    if cls.OP in OPS:
        raise RuntimeError(f"CONTROL op {cls.OP} registered twice")
    OPS[cls.OP] = cls
    return cls


register(Control)  # CONTROL frames decode to the op's class


# ---------------------------------------------------------------- ring set-up and recovery

MAX_SPANS = 32  # compiled spans a stage reports (powers of two: 64 .. 2^37 at most)
MAX_WHY = 300  # characters of why a stage runs eagerly
STAGE_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class StageRun:
    """How a stage runs its one-token decode steps (``join --compile``: node/compute/runtime.py
    ``Models.ran``): ``{"spans": [64, ...], "eager_from": N or null, "eager": why or null,
    "dtype": "bf16"}``; compiled spans and no ``eager``, or no spans and why it runs eagerly.
    ``many``: an object of these by peer ID (at most MAX_HOPS)."""

    many: bool = False

    def read(self, v: Any, fail: _fields.Fail, limits: Limits) -> dict[str, Any]:
        if not self.many:
            return self._one(v, fail)
        if not isinstance(v, dict) or len(v) > MAX_HOPS:
            raise fail(f"expected an object of at most {MAX_HOPS} stages' runs by peer ID")
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, str) or not 0 < len(k) <= MAX_PEER_ID:
                raise fail(f"entry {str(k)[:64]!r}: expected a peer ID of at most {MAX_PEER_ID} characters")

            def named(why: str, k: str = k) -> SwarmError:
                return fail(f"stage {k[:64]!r}: {why}")

            out[k] = self._one(x, named)
        return out

    @staticmethod
    def _one(v: Any, fail: _fields.Fail) -> dict[str, Any]:
        keys = ("spans", "eager_from", "eager", "dtype")
        if not isinstance(v, dict) or set(v) != set(keys):
            raise fail(f"expected an object of exactly {', '.join(keys)}")
        spans, eager_from, eager, dtype = (v[k] for k in keys)
        ints = isinstance(spans, list) and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 40 for n in spans)
        if not ints or len(spans) > MAX_SPANS:
            raise fail(f"spans: expected a list of at most {MAX_SPANS} positive integers")
        if eager_from is not None and (not isinstance(eager_from, int) or isinstance(eager_from, bool) or eager_from < 0):
            raise fail("eager_from: expected a position (an integer >= 0) or null")
        if eager is not None and (not isinstance(eager, str) or not 0 < len(eager) <= MAX_WHY):
            raise fail(f"eager: expected why, at most {MAX_WHY} characters, or null")
        if (eager is None) == (not spans):
            raise fail("expected compiled spans, or why the stage runs eagerly: one of them")
        if dtype not in STAGE_DTYPES:
            raise fail(f"dtype: expected one of {', '.join(STAGE_DTYPES)}")
        return dict(v)

    def write(self, v: Any) -> Any:
        return dict(v)


@op
@dataclass(frozen=True, slots=True)
class Loaded(Control):
    """A peer took a plan (and loaded its block); ``compiled``: how its stage runs (StageRun;
    absent unless it runs ``--compile`` and holds a block)."""

    OP: ClassVar[str] = "loaded"
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))
    compiled: dict[str, Any] | None = meta("compiled", StageRun(), optional=True, default=None)


@op
@dataclass(frozen=True, slots=True)
class Connect(Control):
    """Open every hop that leaves you in ``epoch`` (from that plan's signer)."""

    OP: ClassVar[str] = "connect"
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))


@op
@dataclass(frozen=True, slots=True)
class Linked(Control):
    """The hops that leave this peer are open; how each travels ("hop index" -> path label)."""

    OP: ClassVar[str] = "linked"
    hops: dict[str, str] = meta("hops", StrMap(MAX_HOPS, 8, 200), optional=True, default_factory=dict)


@op
@dataclass(frozen=True, slots=True)
class Serve(Control):
    """Coordinator: start taking generations on ``epoch`` (``hops``: every hop's path label;
    ``compiled``: how each stage runs, by peer, as its ``loaded`` said: for receipts)."""

    OP: ClassVar[str] = "serve"
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))
    hops: dict[str, str] = meta("hops", StrMap(MAX_HOPS, 8, 200), optional=True, default_factory=dict)
    # absent when no stage reported (none runs --compile): a coordinator of an older version reads no such field
    compiled: dict[str, dict[str, Any]] | None = meta("compiled", StageRun(many=True), optional=True, default=None)


@op
@dataclass(frozen=True, slots=True)
class Ack(Control):
    """An acknowledgement (of serve, ended, leaving, leave, fault)."""

    OP: ClassVar[str] = "ack"


@op
@dataclass(frozen=True, slots=True)
class Current(Control):
    """What do you serve? (a peer catching up asks): the serving PLAN, or :class:`NoPlan`."""

    OP: ClassVar[str] = "current"


@op
@dataclass(frozen=True, slots=True)
class NoPlan(Control):
    """Nothing serving here; an ended epoch's plan still says who held what, signed as its
    leader signed it (a peer catching up takes no plan it cannot verify: issue 27)."""

    OP: ClassVar[str] = "none"
    epoch: int | None = meta("epoch", Int(0, EPOCH_MAX), optional=True, default=None)
    plan: dict[str, Any] | None = meta("plan", Obj(), optional=True, default=None)
    signer: bytes | None = meta("signer", B64(32), optional=True, default=None)
    signature: bytes | None = meta("sig", B64(64), optional=True, default=None)

    def signed_plan(self) -> Plan | None:
        """The ended plan as its leader signed it (None when there is none: unsigned is none)."""
        if self.epoch is None or self.plan is None or self.signer is None or self.signature is None:
            return None
        return Plan(self.epoch, self.plan, self.signer, self.signature)


@op
@dataclass(frozen=True, slots=True)
class Ended(Control):
    """A member's ring of ``epoch`` ended and no new plan came (told to the leader)."""

    OP: ClassVar[str] = "ended"
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))


@op
@dataclass(frozen=True, slots=True)
class Leaving(Control):
    """The sender leaves: never plan with it, nor take its plans."""

    OP: ClassVar[str] = "leaving"


@op
@dataclass(frozen=True, slots=True)
class Leave(Control):
    """Leader: re-plan without the sender; answer once a ring without it serves."""

    OP: ClassVar[str] = "leave"


@op
@dataclass(frozen=True, slots=True)
class Fault(Control):
    """Leader: ``peer`` sent the sender bad activations in ``epoch``."""

    OP: ClassVar[str] = "fault"
    peer: str = meta("peer", Str(MAX_PEER_ID))
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))
    reason: str = meta("reason", Str(1000), optional=True, default="")


@op
@dataclass(frozen=True, slots=True)
class BadBytes(Control):
    """Leader: ``peer`` served the sender model bytes (/shard-swarm/tensors/1) that fail the
    model manifest's sha256."""

    OP: ClassVar[str] = "bad_bytes"
    peer: str = meta("peer", Str(MAX_PEER_ID))
    reason: str = meta("reason", Str(1000), optional=True, default="")


@op
@dataclass(frozen=True, slots=True)
class Hop(Control):
    """The first frame of an activation stream: it carries hop ``hop`` of ``epoch``."""

    OP: ClassVar[str] = "hop"
    epoch: int = meta("epoch", Int(0, EPOCH_MAX))
    hop: int = meta("hop", Int(0, 1 << 16))


@op
@dataclass(frozen=True, slots=True)
class Probe(Control):
    """The first frame of a probe on an activation channel, and each ping on it: the other end
    echoes every one back unchanged (``swarm.node.members.probe``: the RTT of the path hops take). The
    nonce is random, so an echo cannot be sent before its ping arrived (a shorter RTT)."""

    OP: ClassVar[str] = "probe"
    nonce: int = meta("nonce", Int(0, (1 << 32) - 1))


# ---------------------------------------------------------------- generation and status


@op
@dataclass(frozen=True, slots=True)
class Gen(Control):
    """The one generation request: a prompt as token ids, or as text the coordinator tokenizes
    (``chat``: through the model's chat template; ``ids`` after a text are tokens a lost
    coordinator had committed, resumed after the text's). ``draft`` None: the node's default;
    ``depth`` None: the ring's own (service.ring_depth). Build one with :meth:`checked`."""

    OP: ClassVar[str] = "gen"
    ids: tuple[int, ...] = ()
    text: str | None = meta("text", Str(MAX_TEXT), optional=True, default=None)
    chat: bool = meta("chat", Bool(), optional=True, default=False)
    max_new_tokens: int = meta("max_new_tokens", Int(1, MAX_NEW_TOKENS), optional=True, default=64)
    temperature: float = meta("temperature", Float(0.0, MAX_TEMPERATURE), optional=True, default=0.0)
    top_k: int = meta("top_k", Int(0, MAX_TOP_K), optional=True, default=0)
    top_p: float = meta("top_p", Float(0.0, 1.0, lo_open=True), optional=True, default=1.0)
    seed: int | None = meta("seed", Int(0, I63), optional=True, default=None)
    draft: str | None = meta("draft", Str(16, choices=DRAFTS), optional=True, default=None)
    depth: int | None = meta("depth", Int(1, MAX_DEPTH), optional=True, default=None)
    draft_k: int | None = meta("draft_k", Int(1, MAX_DRAFT_K), optional=True, default=None)
    wait_s: float = meta("wait_s", Float(0.0, MAX_WAIT_S), optional=True, default=0.0)

    @classmethod
    def checked(cls, ids: tuple[int, ...] | list[int] = (), **fields: Any) -> Gen:
        """A request from local values, checked against the same bounds as one from a peer;
        BadRequest naming the field otherwise."""
        ids = tuple(ids)
        if len(ids) > MAX_PROMPT_IDS or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(f"generation request field 'ids': at most {MAX_PROMPT_IDS} integer token ids", "ids")
        given = {k: v for k, v in fields.items() if v is not None}
        values = read_fields(cls, Fields(given, "generation request", bad_request=True), DEFAULT_LIMITS)
        return cls(ids=ids, **values)

    def resumed(self, committed: list[int]) -> Gen:
        """The rest of this request after ``committed`` tokens (a generation moved to another
        coordinator goes on from the prompt plus what it had committed)."""
        return dataclasses.replace(
            self, ids=(*self.ids, *committed), max_new_tokens=self.max_new_tokens - len(committed)
        )


@op
@dataclass(frozen=True, slots=True)
class Tokens(Control):
    """Newly committed tokens of a generation (``text``: their text, as far as it is whole)."""

    OP: ClassVar[str] = "tokens"
    ids: tuple[int, ...] = ()
    text: str = meta("text", Str(lambda lim: lim.max_string), optional=True, default="")


@op
@dataclass(frozen=True, slots=True)
class Progress(Control):
    """A long prompt's prefill goes on: ``done`` of its ``total`` tokens are through the ring (a
    client and a relaying peer count it as progress, so a long prefill is never taken for silence)."""

    OP: ClassVar[str] = "progress"
    done: int = meta("done", Int(0, MAX_PROMPT_IDS))
    total: int = meta("total", Int(0, MAX_PROMPT_IDS))


@op
@dataclass(frozen=True, slots=True)
class Notice(Control):
    """A generation's one line of news for its client (a pause for a re-plan, the resume)."""

    OP: ClassVar[str] = "notice"
    text: str = meta("text", Str(1000))


@op
@dataclass(frozen=True, slots=True)
class Done(Control):
    """The generation finished; the body is its receipt."""

    OP: ClassVar[str] = "done"
    BODY: ClassVar[str | None] = "receipt"
    receipt: dict[str, Any] = field(default_factory=dict)
    ids: tuple[int, ...] = ()  # on the wire: the receipt's prompt and output token ids (swarm.proto.parts)


@op
@dataclass(frozen=True, slots=True)
class Part(Control):
    """A leading piece of a long message (swarm.proto.parts): token ids and text that the next
    message that is not a part carries on, so that no frame grows with the prompt."""

    OP: ClassVar[str] = "part"
    ids: tuple[int, ...] = ()
    text: str = meta("text", Str(TEXT_PER_FRAME), optional=True, default="")


@op
@dataclass(frozen=True, slots=True)
class Status(Control):
    """What this peer sees (``coordinator``: ask the coordinator, relayed, instead)."""

    OP: ClassVar[str] = "status"
    coordinator: bool = meta("coordinator", Bool(), optional=True, default=False)
    loop_window_s: int = meta("loop_window_s", Int(1, 300), optional=True, default=60)


@op
@dataclass(frozen=True, slots=True)
class StatusReply(Control):
    OP: ClassVar[str] = "status_reply"
    BODY: ClassVar[str | None] = "status"
    status: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- failures, typed both ways

# code -> the error a requester raises; fail_of picks the code of an error raised here
FAIL_CODES: dict[str, type[SwarmError]] = {
    "bad_request": BadRequest,  # the request itself is wrong (a field out of bounds, a bad prompt)
    "forbidden": Forbidden,  # the sender's role may not send it (swarm.node.dispatch)
    "cannot_serve": CannotServe,  # the live peers cannot hold the model (the planner's words)
    "busy": Busy,  # every slot of the ring is taken and its queue is full
    "context_length_exceeded": ContextTooLong,  # the prompt plus max_new_tokens exceed the swarm's context
    "refused": RequestRefused,  # a peer could not serve this request (out of memory): it fails alone
    "unavailable": PeerError,  # anything else on the way: a lost peer, a timeout, no ring yet
}


@op
@dataclass(frozen=True, slots=True)
class Fail(Control):
    """A request that could not be served."""

    OP: ClassVar[str] = "fail"
    code: str = meta("code", Word(32))
    message: str = meta("message", Str(1000), optional=True, default="")
    retry_after_s: int | None = meta("retry_after_s", Int(0, 3600), optional=True, default=None)

    def error(self, prefix: str = "") -> SwarmError:
        """The typed error this failure stands for (an unknown code: PeerError)."""
        kind = FAIL_CODES.get(self.code, PeerError)
        text = prefix + self.message
        if kind is Busy:
            return Busy(text, self.retry_after_s if self.retry_after_s is not None else 5)
        if kind is BadRequest or kind is ContextTooLong:
            return kind(text)
        return kind(text)


def fail_of(exc: SwarmError) -> Fail:
    """The Fail that tells a requester about ``exc``, raised while serving its request."""
    if isinstance(exc, Busy):
        code = "busy"
    elif isinstance(exc, ContextTooLong):
        code = "context_length_exceeded"
    elif isinstance(exc, RequestRefused):
        code = "refused"
    elif isinstance(exc, PlanningError | CannotServe):
        code = "cannot_serve"
    elif isinstance(exc, Forbidden):
        code = "forbidden"
    elif isinstance(exc, UsageError | ProtocolError):
        code = "bad_request"
    else:
        code = "unavailable"
    return Fail(code, str(exc)[:900], exc.retry_after_s if isinstance(exc, Busy) else None)


def expect(reply: Message, kind: type[Control], peer: str, what: str) -> Any:
    """``reply`` as a ``kind``; a Fail becomes its typed error, anything else a ProtocolError."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Fail):
        raise reply.error(f"peer {peer} refused {what}: ")
    raise ProtocolError(f"peer {peer} answered {what} with {reply!r}, expected {kind.OP}")
