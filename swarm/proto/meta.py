"""A frame's JSON metadata block, strictly: one bounded object, canonical bytes both ways.

Decoding refuses anything but one UTF-8 JSON object within :class:`~swarm.proto.limits.Limits`:
no duplicate keys, no NaN/Infinity, bounded depth, string and container sizes, integers within
64 bits, no lone surrogates (which no peer may pass on: they cannot be encoded again). Encoding
applies the same caps, so this node never sends what a receiver refuses.
"""

from __future__ import annotations

import json
import math
from typing import Any

from swarm.errors import FrameError
from swarm.proto.limits import DEFAULT_LIMITS, Limits

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


def _pairs_no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise FrameError(f"frame meta: duplicate key {k[:64]!r}")
        out[k] = v
    return out


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
        raw = json.dumps(
            meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise FrameError(f"frame meta is not JSON-serialisable: {exc}") from None
    try:
        data = raw.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (only a \uD800-style escape makes one)
        raise FrameError(f"frame meta: a string with a lone surrogate at char {exc.start}") from None
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
