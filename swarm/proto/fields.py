"""Declarative message fields: each message lists its fields once, with wire key and bounds.

Theory of operation
-------------------
A message class is a frozen dataclass whose fields say where they travel: ``meta(key, codec)``
puts a field in the frame's JSON metadata (or, for a CONTROL op, in its ``body``) under ``key``,
checked by ``codec``; ``header(name)`` maps it to a frame header field (session, seq, flags,
dtype, shape, payload). :func:`read_fields` and :func:`write_fields` walk that list, so encoding
and strict decoding come from one declaration: every key is required unless declared
``optional`` (then absent means the field's default), unknown keys are refused, and every error names the message, the field and the bound
(``PLAN field 'epoch': -1 outside 0..9223372036854775807``).

A codec's ``read`` turns a JSON value from a peer into the field's value or raises through the
``fail`` it is given; its ``write`` turns the value back into JSON. A bound may depend on the
decoder's :class:`~swarm.proto.limits.Limits` (pass a function of the limits). ``None`` is never
written: a field left at ``None`` is simply absent on the wire (and must have a default).
Several fields may share one JSON object (``group``): an advert's ``device: {kind, name}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from swarm.errors import BadRequest, ProtocolError, SwarmError
from swarm.proto.limits import Limits
from swarm.proto.signing import b64d, b64e

Fail = Callable[[str], SwarmError]
Bound = int | Callable[[Limits], int]
I64_MAX = (1 << 63) - 1


class Codec(Protocol):
    def read(self, v: Any, fail: Fail, limits: Limits) -> Any: ...

    def write(self, v: Any) -> Any: ...


def _bound(b: Bound, limits: Limits) -> int:
    return b(limits) if callable(b) else b


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: Bound = I64_MAX

    def read(self, v: Any, fail: Fail, limits: Limits) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise fail(f"expected an integer, got {type(v).__name__}")
        hi = _bound(self.hi, limits)
        if not self.lo <= v <= hi:
            raise fail(f"{v} outside {self.lo}..{hi}")
        return v

    def write(self, v: Any) -> Any:
        return int(v)


@dataclass(frozen=True)
class Float:
    """A finite number in [lo, hi] (``lo_open``: in (lo, hi]); integers are taken as numbers."""

    lo: float
    hi: float
    lo_open: bool = False

    def read(self, v: Any, fail: Fail, limits: Limits) -> float:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
        if not ok or not (self.lo < v if self.lo_open else self.lo <= v) or v > self.hi:
            span = f"({self.lo:g}, {self.hi:g}]" if self.lo_open else f"[{self.lo:g}, {self.hi:g}]"
            raise fail(f"expected a number in {span}, got {v!r}"[:200])
        return float(v)

    def write(self, v: Any) -> Any:
        return float(v)


@dataclass(frozen=True)
class Str:
    max_len: Bound
    choices: tuple[str, ...] = ()
    min_len: int = 0

    def read(self, v: Any, fail: Fail, limits: Limits) -> str:
        if not isinstance(v, str):
            raise fail(f"expected a string, got {type(v).__name__}")
        hi = _bound(self.max_len, limits)
        if len(v) > hi:
            raise fail(f"{len(v)} chars over the limit {hi}")
        if len(v) < self.min_len:
            raise fail(f"{len(v)} chars, at least {self.min_len} needed")
        if self.choices and v not in self.choices:
            raise fail(f"{v[:32]!r} not one of {', '.join(self.choices)}")
        return v

    def write(self, v: Any) -> Any:
        return v


@dataclass(frozen=True)
class Word:
    """A short machine-readable word: 1..max_len chars of [A-Za-z0-9_-]."""

    max_len: int = 32

    def read(self, v: Any, fail: Fail, limits: Limits) -> str:
        if not isinstance(v, str) or not 0 < len(v) <= self.max_len or not all(
            c.isascii() and (c.isalnum() or c in "_-") for c in v
        ):
            raise fail(f"expected 1..{self.max_len} chars of [A-Za-z0-9_-]")
        return v

    def write(self, v: Any) -> Any:
        return v


@dataclass(frozen=True)
class Bool:
    def read(self, v: Any, fail: Fail, limits: Limits) -> bool:
        if not isinstance(v, bool):
            raise fail(f"expected true/false, got {type(v).__name__}")
        return v

    def write(self, v: Any) -> Any:
        return bool(v)


@dataclass(frozen=True)
class B64:
    """Raw bytes of a fixed length as standard base64 text."""

    length: int

    def read(self, v: Any, fail: Fail, limits: Limits) -> bytes:
        try:
            return b64d(v, field="", length=self.length)
        except ProtocolError as exc:
            raise fail(str(exc).split(": ", 1)[-1]) from None

    def write(self, v: Any) -> Any:
        return b64e(v)


@dataclass(frozen=True)
class Obj:
    """Any JSON object (its size and depth are bounded by the frame's limits)."""

    def read(self, v: Any, fail: Fail, limits: Limits) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise fail("expected a JSON object")
        return v

    def write(self, v: Any) -> Any:
        return v


@dataclass(frozen=True)
class Addrs:
    """A list of multiaddr strings (each starting with '/', at most 256 chars)."""

    max_items: Bound

    def read(self, v: Any, fail: Fail, limits: Limits) -> tuple[str, ...]:
        hi = _bound(self.max_items, limits)
        if not isinstance(v, list) or len(v) > hi:
            raise fail(f"expected a list of at most {hi} multiaddrs")
        if not all(isinstance(a, str) and a.startswith("/") and len(a) <= 256 for a in v):
            raise fail("every entry must be a multiaddr string (starting with '/', <= 256 chars)")
        return tuple(v)

    def write(self, v: Any) -> Any:
        return list(v)


@dataclass(frozen=True)
class IntMap:
    """An object of at most ``max_items`` entries, keys of at most ``key_len`` chars, values ints."""

    max_items: Bound
    key_len: int
    lo: int
    hi: int
    what: str = "peers"
    unit: str = "an integer"

    def read(self, v: Any, fail: Fail, limits: Limits) -> dict[str, int]:
        hi = _bound(self.max_items, limits)
        if not isinstance(v, dict) or len(v) > hi:
            raise fail(f"expected an object of at most {hi} {self.what}")
        for k, x in v.items():
            if len(k) > self.key_len or isinstance(x, bool) or not isinstance(x, int) or not self.lo <= x <= self.hi:
                raise fail(f"entry {k[:64]!r}: expected {self.unit} {self.lo}..{self.hi:g}")
        return dict(v)

    def write(self, v: Any) -> Any:
        return dict(v)


@dataclass(frozen=True)
class StrMap:
    """``{"hop index": "label"}`` and the like: at most ``max_items`` string -> string entries."""

    max_items: int
    key_len: int
    value_len: int

    def read(self, v: Any, fail: Fail, limits: Limits) -> dict[str, str]:
        if not isinstance(v, dict) or len(v) > self.max_items:
            raise fail(f"expected an object of at most {self.max_items} entries")
        for k, x in v.items():
            if len(k) > self.key_len or not isinstance(x, str) or len(x) > self.value_len:
                raise fail(f"entry {k[:64]!r}: expected a string of at most {self.value_len} chars")
        return dict(v)

    def write(self, v: Any) -> Any:
        return dict(v)


# ---------------------------------------------------------------- declaring fields


@dataclass(frozen=True)
class Wire:
    key: str | None  # JSON key (None: a header field)
    codec: Codec | None
    header: str | None = None  # frame header field it maps to (or also equals, with a key)
    group: str | None = None  # the JSON object this key lives in (advert "device")
    optional: bool = False  # may be absent on the wire (the field's default is taken)


def meta(
    key: str, codec: Codec, *, header: str | None = None, group: str | None = None, optional: bool = False, **kw: Any
) -> Any:
    """A field carried in the JSON metadata under ``key`` (``header``: it also fills, and must
    agree with, that frame header field; ``group``: inside the JSON object of that name;
    ``optional``: it may be absent, meaning the field's default, which it then needs)."""
    if optional and "default" not in kw and "default_factory" not in kw:
        raise TypeError(f"optional field {key!r} needs a default")
    return dataclasses.field(metadata={"wire": Wire(key, codec, header, group, optional)}, **kw)


def header(name: str, **kw: Any) -> Any:
    """A field carried in the frame header: session, seq, flags, dtype, shape or payload."""
    return dataclasses.field(metadata={"wire": Wire(None, None, name)}, **kw)


def wire_fields(cls: type) -> list[tuple[str, Wire, dataclasses.Field[Any]]]:
    cached: list[tuple[str, Wire, dataclasses.Field[Any]]] | None = cls.__dict__.get("_wire_cache")
    if cached is None:
        cached = [(f.name, f.metadata["wire"], f) for f in dataclasses.fields(cls) if "wire" in f.metadata]
        setattr(cls, "_wire_cache", cached)  # noqa: B010 - a class attribute outside the slots
    return cached


class Fields:
    """Strict reads of one JSON object; every error names ``what`` (the message) and the key.
    A peer's bytes raise ProtocolError; a request built here (``bad_request``) raises
    BadRequest naming the field, for the API to name the parameter."""

    def __init__(self, values: Mapping[str, Any], what: str, *, bad_request: bool = False) -> None:
        self.values = values
        self.what = what
        self.bad_request = bad_request
        self.seen: set[str] = set()

    def fail(self, key: str, why: str) -> SwarmError:
        text = f"{self.what} field '{key}': {why}"
        return BadRequest(text, key) if self.bad_request else ProtocolError(text)

    def done(self) -> None:
        extra = sorted(set(self.values) - self.seen)
        if extra:
            raise self.fail(extra[0][:64], "unknown field")


def read_fields(cls: type, src: Fields, limits: Limits, frame_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The constructor arguments of ``cls`` from ``src`` (and the header values it maps)."""
    out: dict[str, Any] = {}
    groups: dict[str, Fields] = {}
    for name, w, _ in wire_fields(cls):
        if w.key is None:
            assert frame_values is not None and w.header is not None
            out[name] = frame_values[w.header]
            continue
        where = src
        if w.group is not None:
            where = groups.get(w.group) or _group(cls, src, w.group, groups)
        where.seen.add(w.key)
        if w.key not in where.values:
            if w.optional:
                continue
            raise src.fail(w.key if w.group is None else w.group, "missing")
        key = w.key

        def fail(why: str, _key: str = key, _group: str | None = w.group) -> SwarmError:
            return src.fail(_key, why) if _group is None else src.fail(_group, f"{_key}: {why}")

        assert w.codec is not None
        out[name] = w.codec.read(where.values[w.key], fail, limits)
        if w.header is not None and frame_values is not None and frame_values[w.header] != out[name]:
            raise src.fail(w.key, f"{out[name]} disagrees with the header's {frame_values[w.header]}")
    for g in groups.values():
        g.done()
    src.done()
    return out


def _group(cls: type, src: Fields, group: str, groups: dict[str, Fields]) -> Fields:
    src.seen.add(group)
    raw = src.values.get(group)
    keys = [w.key for _, w, _ in wire_fields(cls) if w.group == group]
    if not isinstance(raw, dict) or set(raw) != set(keys):
        raise src.fail(group, "expected {" + ", ".join(k for k in keys if k) + "}")
    groups[group] = Fields(raw, src.what)
    return groups[group]


def write_fields(obj: Any, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The JSON object of ``obj``'s keyed fields (``None`` values left out)."""
    out: dict[str, Any] = {}
    for name, w, _ in wire_fields(type(obj)):
        v = getattr(obj, name)
        if w.key is None or v is None or w.key in skip:
            continue
        assert w.codec is not None
        target = out if w.group is None else out.setdefault(w.group, {})
        target[w.key] = w.codec.write(v)
    return out


def header_values(obj: Any) -> Iterator[tuple[str, Any]]:
    """(header field, value) of every field of ``obj`` that travels in, or fills, the header."""
    for name, w, _ in wire_fields(type(obj)):
        if w.header is not None:
            yield w.header, getattr(obj, name)


class Declared:
    """Marker base: a message whose fields are declared with :func:`meta` / :func:`header`."""

    NAME: ClassVar[str]
