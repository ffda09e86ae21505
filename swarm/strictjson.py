"""JSON as this project signs and strictly reads it, for the layers that may not import each other
(manifest/'s signed files, proto/'s frame metadata and signed adverts): the one canonical encoding,
and strict reading's rule against repeated keys. A leaf like ``swarm.errors``: it imports nothing of
swarm, and every layer may import it (tests/test_layering.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def canonical(obj: Any) -> bytes:
    """Sorted keys, compact, UTF-8, no NaN/Infinity. Raises UnicodeEncodeError for a lone
    surrogate, TypeError/ValueError for what JSON cannot hold; callers name the object."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def unique_keys(error: Callable[[str], Exception]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` ``object_pairs_hook`` that raises ``error("duplicate key 'k'")`` at a key
    repeated in one object (JSON allows it; a signer and a reader that kept different copies would
    disagree on what was signed)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise error(f"duplicate key {k[:64]!r}")
            out[k] = v
        return out

    return pairs
