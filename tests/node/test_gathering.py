"""The gathering policy (node/ring/gathering.py) on virtual time: which sessions a stage's next
forward waits for, how long, and when it does not wait at all. A mock clock makes every window
exact; the real stage worker's gathering is measured in tests/node/test_ring_mem.py."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import pytest
import torch
import trio
import trio.testing

from swarm.node.ring.codec import REPLAY_ID_BASE, hidden_chunk
from swarm.node.ring.gathering import (
    GATHER_MAX_S,
    GATHER_MERGE_MAX_S,
    Gatherer,
    GatherStats,
    Inbound,
    hand_off,
)
from swarm.proto.messages import Chunk


class _Stage:
    """What a Gatherer reads of a Stage: the sessions it has open."""

    def __init__(self, sessions: set[int]) -> None:
        self.open = sessions

    def sessions(self) -> list[int]:
        return sorted(self.open)


def _chunk(session: int, chunk_id: int = 1) -> Chunk:
    return hidden_chunk(session, chunk_id, 0, "decode", torch.zeros(1, 4), epoch=0)


def _gatherer(sessions: set[int], max_batch: int = 8) -> Gatherer:
    return Gatherer(_Stage(sessions), GatherStats(), max_batch)  # type: ignore[arg-type]


async def _wait(g: Gatherer, pending: deque[Inbound], arrivals: list[tuple[float, int]]) -> float:
    """Run ``g.wait`` while ``arrivals`` (delay, session) come in; the time it took."""
    send, recv = trio.open_memory_channel[Inbound](16)
    t0 = trio.current_time()

    async def feed() -> None:
        start = trio.current_time()
        for delay, session in arrivals:
            await trio.sleep_until(start + delay)
            g.note_arrival(session)
            await send.send(_chunk(session))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        await g.wait(recv, pending)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    return took


def _shared_forward(g: Gatherer, sessions: set[int], took: float = 0.02) -> None:
    g.note_forward(frozenset(sessions), took, small=True)


async def test_a_lone_session_never_waits(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1})
    _shared_forward(g, {1})
    await trio.sleep(0.01)
    g.note_arrival(1)
    assert await _wait(g, deque([_chunk(1)]), []) == 0.0
    assert g.stats.gathers == 0


async def test_before_the_first_small_forward_the_window_is_the_cap(autojump_clock: trio.testing.MockClock) -> None:
    """No typical time yet (inf): ``min(inf, GATHER_MAX_S)`` waits the cap. (So the ``window ==
    math.inf`` test in ``Gatherer.wait`` never fires; this pins what the code does today.)"""
    g = _gatherer({1, 2})
    assert g.typical_s == math.inf
    g.note_forward(frozenset({1, 2}), 0.5, small=False)  # a prefill piece is no window sample
    assert g.typical_s == math.inf
    await trio.sleep(0.01)
    g.note_arrival(1)
    assert await _wait(g, deque([_chunk(1)]), []) == pytest.approx(GATHER_MAX_S)


async def test_sessions_that_shared_a_forward_are_waited_for_and_the_wait_ends_when_they_come(
    autojump_clock: trio.testing.MockClock,
) -> None:
    g = _gatherer({1, 2, 3})
    _shared_forward(g, {1, 2, 3}, took=0.02)
    await trio.sleep(0.01)
    g.note_arrival(1)
    pending = deque([_chunk(1)])
    took = await _wait(g, pending, [(0.004, 2), (0.007, 3)])
    assert took == pytest.approx(0.007)
    assert sorted(f.session for f in pending) == [1, 2, 3]
    assert (g.stats.gathers, g.stats.gather_timeouts, g.stats.merges) == (1, 0, 0)


async def test_a_straggler_is_waited_for_one_typical_forward_then_left(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2})
    _shared_forward(g, {1, 2}, took=0.02)
    _shared_forward(g, {1, 2}, took=0.03)  # the window is a running mean: 0.8 * 0.02 + 0.2 * 0.03
    await trio.sleep(0.01)
    g.note_arrival(1)
    pending = deque([_chunk(1)])
    assert await _wait(g, pending, [(1.0, 2)]) == pytest.approx(0.022)
    assert [f.session for f in pending] == [1]
    assert (g.stats.gathers, g.stats.gather_timeouts) == (1, 1)
    assert g.stats.gather_s == pytest.approx(0.022)


async def test_the_window_is_capped(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2})
    _shared_forward(g, {1, 2}, took=5.0)  # a slow machine's forward still waits at most GATHER_MAX_S
    await trio.sleep(0.01)
    g.note_arrival(1)
    assert await _wait(g, deque([_chunk(1)]), []) == pytest.approx(GATHER_MAX_S)


async def test_a_second_chunk_in_flight_is_not_a_reason_to_wait(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2})
    g.note_arrival(1)  # read before the forward ended: sent before its results came back
    _shared_forward(g, {1, 2})
    assert await _wait(g, deque([_chunk(1)]), [(0.001, 2)]) == 0.0


async def test_replay_chunks_and_a_full_batch_and_a_disabled_gatherer_never_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for case in ("replay", "full", "disabled"):
        g = _gatherer({1, 2, 3}, max_batch=2 if case == "full" else 8)
        g.enabled = case != "disabled"
        _shared_forward(g, {1, 2, 3})
        await trio.sleep(0.01)
        g.note_arrival(1)
        g.note_arrival(3)
        pending = deque([_chunk(1, REPLAY_ID_BASE + 1 if case == "replay" else 1), _chunk(3)])
        assert await _wait(g, pending, [(0.001, 2)]) == 0.0, case


async def _cycles(g: Gatherer, groups: list[set[int]], cycle: float, rounds: int = 3) -> None:
    """Each group's chunks arrive together once per ``cycle``, forwarded separately."""
    for _ in range(rounds):
        for group in groups:
            for s in sorted(group):
                g.note_arrival(s)
            g.note_forward(frozenset(group), 0.01, small=True)
            await trio.sleep(cycle / len(groups))


async def test_the_smaller_group_waits_to_merge_with_the_others(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2, 3})
    await _cycles(g, [{1, 2}, {3}], cycle=0.2)
    g.note_arrival(3)
    pending = deque([_chunk(3)])
    took = await _wait(g, pending, [(0.05, 1), (0.06, 2)])
    assert took == pytest.approx(0.06)
    assert sorted(f.session for f in pending) == [1, 2, 3]
    assert g.stats.merges == 1


async def test_the_larger_group_does_not_wait_for_the_smaller(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2, 3})
    await _cycles(g, [{3}, {1, 2}], cycle=0.2)
    g.note_arrival(1)
    g.note_arrival(2)
    assert await _wait(g, deque([_chunk(1), _chunk(2)]), [(0.05, 3)]) == 0.0
    assert g.stats.merges == 0


async def test_a_merge_wait_is_bounded_and_a_tie_waits_on_the_group_without_the_lowest_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    g = _gatherer({1, 2})
    await _cycles(g, [{1}, {2}], cycle=2.0)  # slow cycles: the wait is cut at GATHER_MERGE_MAX_S
    g.note_arrival(2)
    assert await _wait(g, deque([_chunk(2)]), []) == pytest.approx(GATHER_MERGE_MAX_S)
    g.note_arrival(1)
    assert await _wait(g, deque([_chunk(1)]), []) == 0.0, "the group holding the lowest id goes on"


async def test_a_session_quiet_for_two_cycles_or_forgotten_is_not_waited_for(autojump_clock: trio.testing.MockClock) -> None:
    g = _gatherer({1, 2})
    await _cycles(g, [{1}, {2}], cycle=0.2)
    await trio.sleep(0.5)  # session 1 has been quiet for more than two of its cycles
    g.note_arrival(2)
    assert await _wait(g, deque([_chunk(2)]), []) == 0.0
    g.forget(1)
    assert 1 not in g.arrived and 1 not in g.cycle and 1 not in g.mates


async def test_a_readers_hand_off_lets_the_task_it_woke_run_before_its_next_step() -> None:
    """Trio runs a batch in random order: with one checkpoint the reader would go first in about
    half of these 20 hand-offs (its next receive on the message's way to its forward)."""
    send, recv = trio.open_memory_channel[int](math.inf)
    order: list[str] = []

    async def receiver() -> None:
        await recv.receive()
        order.append("woken")

    for i in range(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            await hand_off(send, i)
            order.append("reader")
    assert order == ["woken", "reader"] * 20


async def test_a_hand_off_to_a_busy_receiver_or_to_nobody_yields_once(checkpoints: Callable[[], list[int]]) -> None:
    """A burst queues while the receiver computes: the reader drains it one checkpoint a frame."""
    passes = checkpoints()
    send, recv = trio.open_memory_channel[int](math.inf)
    await hand_off(send, 1)
    await hand_off(None, 2)  # a session that ended: the message is dropped
    assert passes[0] == 2 and recv.receive_nowait() == 1
    with pytest.raises(trio.WouldBlock):
        recv.receive_nowait()
