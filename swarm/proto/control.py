"""CONTROL: the swarm's small requests and replies (ring set-up, generation requests, status).

One message type with an ``op`` word from a fixed set and a JSON ``body`` whose keys each op's
handler reads through :class:`Body` (every access names the op and field in its error), plus an
optional INT32 (T,) tensor of token ids (a prompt, or newly committed tokens): token lists can be
long, and JSON lists are capped at ``max_list`` entries.

Ops, by protocol:

- ring set-up (``/shard-swarm/ring/1``): ``plan`` is sent as a PLAN message; replies ``loaded``;
  then ``connect`` -> ``linked``; ``serve`` -> ``serving``; ``hop`` opens an activation stream.
- generation (``/shard-swarm/gen/1``): ``gen`` (ids = prompt ids, or body.text) -> ``tokens``
  (ids = newly committed tokens, body.text = their text) ... -> ``done`` (body = receipt);
  ``status`` -> ``status_reply``.
- any: ``fail`` (body.code, body.message) answers a request that could not be served.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarm.errors import ProtocolError
from swarm.proto.frame import DType, Frame, MsgType
from swarm.proto.limits import Limits
from swarm.proto.messages import Message, Meta, register

OPS = (
    "loaded", "connect", "linked", "serve", "serving", "hop",
    "gen", "tokens", "notice", "done", "status", "status_reply", "fail", "leave", "leaving", "fault", "current", "none", "ended",
)  # fmt: skip
MAX_IDS = 1 << 16  # token ids in one CONTROL (prompt or committed tokens)


@register
@dataclass(frozen=True, slots=True)
class Control(Message):
    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    op: str
    body: dict[str, Any] = field(default_factory=dict)
    ids: tuple[int, ...] = ()
    session: int = 0

    def __repr__(self) -> str:
        return f"Control({self.op}, keys={sorted(self.body)}, ids={len(self.ids)})"

    def to_frame(self) -> Frame:
        if self.ids:
            payload = b"".join(int(t).to_bytes(4, "little", signed=True) for t in self.ids)
            return Frame(
                self.TYPE,
                self.session,
                0,
                0,
                DType.INT32,
                (len(self.ids),),
                {"op": self.op, "body": self.body},
                payload,
            )
        return Frame(self.TYPE, self.session, meta={"op": self.op, "body": self.body})

    @classmethod
    def from_frame(cls, frame: Frame, limits: Limits) -> Control:
        m = Meta(frame, "CONTROL")
        op = m.get_str("op", 16, choices=OPS)
        body = m.get_raw("body")
        if not isinstance(body, dict):
            raise m.fail("body", "expected a JSON object")
        m.done()
        ids: tuple[int, ...] = ()
        if frame.dtype is DType.INT32:
            if len(frame.shape) != 1 or frame.shape[0] > MAX_IDS:
                raise ProtocolError(
                    f"CONTROL field 'shape': token ids are (T,) with T <= {MAX_IDS}, got {frame.shape}"
                )
            raw = frame.payload
            ids = tuple(
                int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)
            )
        elif frame.dtype is not DType.NONE:
            raise ProtocolError(
                f"CONTROL field 'dtype': {frame.dtype.name}, expected INT32 token ids or none"
            )
        return cls(op, body, ids, frame.session)

    def body_reader(self) -> Body:
        return Body(self.op, self.body)


class Body:
    """Typed reads of a CONTROL body: every error names the op and the field."""

    def __init__(self, op: str, body: dict[str, Any], path: str = "") -> None:
        self.op, self.body, self.path = op, body, path

    def _fail(self, key: str, why: str) -> ProtocolError:
        return ProtocolError(f"CONTROL {self.op} field '{self.path}{key}': {why}")

    def sub(self, key: str) -> Body:
        v = self.body.get(key)
        if not isinstance(v, dict):
            raise self._fail(key, "expected an object")
        return Body(self.op, v, f"{self.path}{key}.")

    def int(self, key: str, lo: int, hi: int, default: int | None = None) -> int:
        v = self.body.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._fail(key, f"expected an integer in {lo}..{hi}, got {v!r}")
        return v

    def float(self, key: str, lo: float, hi: float, default: float | None = None) -> float:
        v = self.body.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            raise self._fail(key, f"expected a number in {lo}..{hi}, got {v!r}")
        return float(v)

    def str(
        self, key: builtins.str, max_len: builtins.int, default: builtins.str | None = None
    ) -> builtins.str:
        v = self.body.get(key, default)
        if not isinstance(v, str) or len(v) > max_len:
            raise self._fail(key, f"expected a string of at most {max_len} chars")
        return v

    def bool(self, key: builtins.str, default: bool | None = None) -> bool:
        v = self.body.get(key, default)
        if not isinstance(v, bool):
            raise self._fail(key, f"expected true or false, got {v!r}")
        return v

    def optional(self, key: builtins.str) -> Any:
        return self.body.get(key)
