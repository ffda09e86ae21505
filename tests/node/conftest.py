"""Fixtures shared by node/'s tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio


@pytest.fixture
def checkpoints(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[int]]:
    """``checkpoints()`` starts counting trio's scheduler passes (``trio.lowlevel.checkpoint``
    calls) and returns the count, a one-element list a test reads and may reset."""

    def start() -> list[int]:
        passes = [0]
        checkpoint = trio.lowlevel.checkpoint

        async def counted() -> None:
            passes[0] += 1
            await checkpoint()

        monkeypatch.setattr(trio.lowlevel, "checkpoint", counted)
        return passes

    return start
