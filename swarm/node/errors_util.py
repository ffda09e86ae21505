"""Unwrapping trio's exception groups at the node's boundaries.

trio nurseries wrap whatever their tasks raise in an ExceptionGroup; the node's callers expect
our own error types (SwarmError subclasses) so that they can answer a client or end an epoch.
"""

from __future__ import annotations

import trio


def unwrap(exc: BaseException) -> BaseException:
    """The single leaf of nested one-member exception groups (else the group itself). The
    Cancelled of an enclosing scope (the node leaving while a link fails) does not count as a
    second error: the error comes out alone, and the next checkpoint raises the cancellation
    again (trio's cancellation is level-triggered), so nothing that should stop keeps running."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
            continue
        cancelled, rest = exc.split(trio.Cancelled)
        if cancelled is None or rest is None:
            break
        exc = rest
    return exc


def first_leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` anywhere in ``exc`` (a group or not)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = first_leaf(sub, kind)
            if found is not None:
                return found
    return None
