"""Text that other peers supply, made safe for a terminal, a log line or JSON (issue 27).

Members describe themselves (device and model names), explain failures (errors, causes) and
relay one another's words. Such text reaches ``shard-swarm status``, node logs and JSON replies;
a terminal escape sequence in a device name must not move a cursor, recolour a screen or forge a
log line there, and a lone surrogate must not make a JSON encoder fail. Both helpers are total
(any object, never an exception) and keep every printable character as it was.
"""

from __future__ import annotations

from typing import Any


def _bad(c: str) -> bool:
    return not c.isprintable() or 0xD800 <= ord(c) <= 0xDFFF


def printable(text: Any) -> str:
    """A peer's words for one log line: control characters and lone surrogates escaped
    (``\\x{1b}``), so what was sent can still be read."""
    return "".join(f"\\x{{{ord(c):x}}}" if _bad(c) else c for c in str(text))


def clean(text: Any, limit: int | None = None) -> str:
    """A peer's words for a terminal or JSON: control characters and lone surrogates dropped,
    then cut to ``limit`` characters (None: whole)."""
    out = "".join(c for c in str(text) if not _bad(c))
    return out if limit is None else out[:limit]
