"""The coordinator's shared LM head (node/compute/headbatch.py): sessions whose rows queue
together share one call, each gets back exactly its own rows, a failing call fails each of its
sessions and not the next call. The head here is an exact elementwise map (the batching is under
test, not a GEMM's rounding); the real head's batched tokens are checked in test_ring_mem.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import trio

from swarm.node.compute.headbatch import MAX_HEAD_BATCH, SharedHead
from swarm.node.compute.runtime import Compute


class _Head:
    def __init__(self) -> None:
        self.calls: list[int] = []  # rows per call
        self.fail = False

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(rows.shape[0])
        if self.fail:
            raise RuntimeError("head broke")
        return torch.cat([rows * 2, rows + 1], dim=1)  # (T, 2D): each row's own, exactly


def _shared(head: _Head, live: set[int]) -> SharedHead:
    return SharedHead(head, Compute(threads=False), live=lambda: live)  # type: ignore[arg-type]


def _rows(session: int, t: int = 2, d: int = 3) -> torch.Tensor:
    return torch.full((t, d), float(session)) + torch.arange(t * d, dtype=torch.float32).view(t, d)


async def test_sessions_queued_together_share_one_call_and_get_their_own_rows() -> None:
    head = _Head()
    shared = _shared(head, {1, 2, 3})
    got: dict[int, tuple[torch.Tensor, bool]] = {}

    async def ask(session: int, t: int) -> None:
        got[session] = await shared.logits(_rows(session, t), session)

    async with trio.open_nursery() as nursery:
        for session, t in ((1, 1), (2, 3), (3, 2)):
            nursery.start_soon(ask, session, t)
    assert head.calls == [6], "one call for the three sessions' 1 + 3 + 2 rows"
    for session, t in ((1, 1), (2, 3), (3, 2)):
        out, was_shared = got[session]
        rows = _rows(session, t)
        assert was_shared and torch.equal(out, torch.cat([rows * 2, rows + 1], dim=1))


async def test_a_lone_session_is_not_shared() -> None:
    head = _Head()
    out, was_shared = await _shared(head, {1}).logits(_rows(1), 1)
    assert head.calls == [2] and not was_shared and out.shape == (2, 6)


async def test_more_than_a_batch_of_sessions_takes_several_calls() -> None:
    head = _Head()
    n = MAX_HEAD_BATCH + 5
    shared = _shared(head, set(range(n)))
    async with trio.open_nursery() as nursery:
        for s in range(n):
            nursery.start_soon(shared.logits, _rows(s, 1), s)
    assert head.calls == [MAX_HEAD_BATCH, 5]


async def test_a_failed_call_fails_each_of_its_sessions_and_the_head_serves_on() -> None:
    head = _Head()
    head.fail = True
    shared = _shared(head, {1, 2})
    errors: list[str] = []

    async def ask(session: int) -> None:
        try:
            await shared.logits(_rows(session), session)
        except RuntimeError as exc:
            errors.append(f"{session}: {exc}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, 1)
        nursery.start_soon(ask, 2)
    assert sorted(errors) == ["1: head broke", "2: head broke"] and head.calls == [4]
    head.fail = False
    out, _ = await shared.logits(_rows(1), 1)
    assert out.shape == (2, 6)


async def test_forget_drops_a_sessions_timing_state() -> None:
    shared = _shared(_Head(), {1})
    shared.note_result(1)
    await trio.sleep(0)
    shared.note_result(1)
    await shared.logits(_rows(1), 1)
    assert 1 in shared._result_at and 1 in shared._cycle and 1 in shared._mates
    shared.forget(1)
    assert 1 not in shared._result_at and 1 not in shared._cycle and 1 not in shared._mates


class _ThreadHead:
    def __init__(self) -> None:
        self.threads: list[bool] = []  # per call: did it run on the trio thread

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread() is threading.main_thread())
        return rows * 2


async def test_the_head_runs_a_lone_sessions_call_inline_and_a_shared_call_in_a_worker() -> None:
    head = _ThreadHead()
    live = {1, 2}
    shared = SharedHead(head, Compute(), live=lambda: live)  # type: ignore[arg-type]
    # each call "takes" 20 ms: over INLINE_MAX_S, under LONE_INLINE_MAX_S (given, not measured)
    shared._compute = lambda rows: (head.logits(rows), 0.02)  # type: ignore[method-assign]
    rows = torch.ones(1, 3)
    await shared.logits(rows, 1)
    assert head.threads == [False], "the first call's time is unknown: a worker thread"
    await shared.logits(rows, 1)
    await shared.logits(rows, 2)
    assert head.threads[1:] == [True, True], "one session's rows alone in the call: inline"
    async with trio.open_nursery() as nursery:
        for session in (1, 2):
            nursery.start_soon(shared.logits, rows, session)
    assert head.threads[3:] == [False], "two sessions' rows in one 20 ms call: a worker thread"


async def test_a_lone_generations_head_call_takes_no_scheduler_pass(checkpoints: Callable[[], list[int]]) -> None:
    """Nobody else is generating, so nobody can join the call: no gathering passes on the token's
    path, and none after it."""
    passes = checkpoints()
    head = _Head()
    seen: list[int] = []
    head.logits = lambda rows: (seen.append(passes[0]), torch.cat([rows * 2, rows + 1], dim=1))[1]  # type: ignore[method-assign]
    await _shared(head, {1}).logits(_rows(1), 1)
    after = [passes[0]]
    passes[0] = 0
    await _shared(head, {1, 2}).logits(_rows(1), 1)  # session 2 may queue too: the idle head lets it
    after.append(passes[0])
    assert seen == [0, 1], "passes before the head computed: none alone, one with another generating"
    assert after == [0, 1], "after a call of one session's rows its task's next await yields (it sends first)"
