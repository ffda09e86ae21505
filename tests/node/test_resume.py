"""A generation outliving its ring (node/generation/resume.py), on a mock clock: how a run waits
for the next epoch (serving, or coordinated elsewhere), what its client hears while it waits, when
it gives up (no plan in time; a swarm too small for longer than the grace), and how ``drive``
moves a run whose ring failed onto the next epoch's ring or hands it to the new coordinator.

The epochs are the real ones of a standby (nothing to load: tests/node/test_epochs.py); a
coordinator is a small fake whose ``drive`` fails or finishes as a test says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import FaultyPeer, PeerError, PeerLost, PlanningError
from swarm.node.generation.resume import NOTICE_EVERY_S, PROBLEM_GRACE_S, CoordinatorMoved, Resumer
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan

ME = "C"


def _plan(epoch: int, coord: str = ME, ring: tuple[str, ...] = ("A", "B")) -> Plan:
    return Plan(epoch, 6, coord, ring, {p: (3 * i, 3 * i + 3) for i, p in enumerate(ring)}, (), 1.0, 1.0, layers_moved=3)


def _epochs() -> Epochs:
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    return Epochs(settings, ME, None, SlotQueue(), Notices(Hooks()), leader=lambda: "L", memory=dict)  # type: ignore[arg-type]


def _resumer(epochs: Epochs, problem: list[str | None] | None = None) -> tuple[Resumer, list[tuple[str, str, int]]]:
    faults: list[tuple[str, str, int]] = []

    async def report_fault(peer: str, why: str, epoch: int) -> None:
        faults.append((peer, why, epoch))

    box = problem if problem is not None else [None]
    return Resumer(ME, epochs, Notices(Hooks()), lambda: box[0], report_fault), faults


def _take(epochs: Epochs, plan: Plan, *, serving: bool) -> Epoch:
    """The epoch ``plan`` becomes the current one here (as ``Epochs.accept`` leaves it)."""
    if epochs.current is not None:
        epochs.end(f"replaced by epoch {plan.epoch}")
    ep = Epoch(plan, b"")
    epochs.previous, epochs.current = epochs.current, ep
    epochs.notify()
    if serving:
        epochs.mark_serving(ep)
    return ep


async def test_the_next_epoch_is_returned_the_moment_it_serves(autojump_clock: trio.testing.MockClock) -> None:
    epochs = _epochs()
    _take(epochs, _plan(3), serving=True)
    resumer, _ = _resumer(epochs)
    got: list[tuple[float, int]] = []

    async def wait() -> None:
        ep = await resumer.next_epoch(3, timeout=60)
        got.append((trio.current_time(), ep.plan.epoch))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.sleep(5)
        assert got == []  # epoch 3 serves, but it is the one the run failed on
        nxt = _take(epochs, _plan(4), serving=False)
        await trio.sleep(2)
        assert got == []  # set up here, not yet serving
        epochs.mark_serving(nxt)
    assert got == [(7.0, 4)]  # resumed the moment it serves (woken, not polling)


async def test_an_epoch_coordinated_elsewhere_is_returned_before_it_serves(autojump_clock: trio.testing.MockClock) -> None:
    epochs = _epochs()
    _take(epochs, _plan(8, coord="Z"), serving=False)
    resumer, _ = _resumer(epochs)
    ep = await resumer.next_epoch(7, timeout=60)
    assert ep.plan.coordinator == "Z" and trio.current_time() == 0  # that coordinator's ring: not ours to wait for


async def test_a_waiting_run_is_told_every_few_seconds_and_gives_up_at_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    epochs = _epochs()
    resumer, _ = _resumer(epochs)
    waited: list[float] = []
    with pytest.raises(PeerError, match="did not recover within 9 s"):
        await resumer.next_epoch(0, timeout=9, on_wait=waited.append)
    assert trio.current_time() == pytest.approx(9.0)
    n = int(9 // NOTICE_EVERY_S)
    assert [round(w / NOTICE_EVERY_S) for w in waited] == list(range(1, n + 1))


async def test_a_swarm_too_small_for_longer_than_the_grace_fails_the_run(autojump_clock: trio.testing.MockClock) -> None:
    epochs = _epochs()
    problem: list[str | None] = ["2.1 GB missing"]
    resumer, _ = _resumer(epochs, problem)
    with pytest.raises(PlanningError, match="cannot serve: 2.1 GB missing"):
        await resumer.next_epoch(0, timeout=60)
    # first seen at the 1 s check, given up at the first check past the grace
    assert 1.0 + PROBLEM_GRACE_S < trio.current_time() <= 2.0 + PROBLEM_GRACE_S + 0.06


async def test_a_planning_problem_that_clears_restarts_the_grace(autojump_clock: trio.testing.MockClock) -> None:
    epochs = _epochs()
    problem: list[str | None] = ["too small"]
    resumer, _ = _resumer(epochs, problem)

    async def flicker() -> None:  # the problem clears for 1.4 s every 3.7 s: never past the grace
        while True:  # (a clearing spans a once-a-second check whichever runs first at a tied instant)
            await trio.sleep(2.3)
            problem[0] = None
            await trio.sleep(1.4)
            problem[0] = "too small"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flicker)
        with pytest.raises(PeerError, match="did not recover") as info:
            await resumer.next_epoch(0, timeout=20)
        nursery.cancel_scope.cancel()
    assert not isinstance(info.value, PlanningError)


async def test_a_planning_check_slower_than_its_second_keeps_the_run_waiting(autojump_clock: trio.testing.MockClock) -> None:
    """The once-a-second planning check costs CPU: on a busy node it took longer than the second
    to the next one, whose deadline was then past when the wait was computed (a negative timeout
    crashed the run's handler, and its client saw the stream close: CI, stop 40). The run waits on
    and takes the next epoch when it serves."""
    epochs = _epochs()
    checks = [0]

    def slow_check() -> str | None:
        checks[0] += 1
        autojump_clock.jump(1.7)  # the check ran 1.7 s on the node's clock
        return None

    resumer, _ = _resumer(epochs)
    resumer.planning_problem = slow_check

    async def serve_later() -> None:
        await trio.sleep(6.0)
        _take(epochs, _plan(1), serving=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_later)
        ep = await resumer.next_epoch(0, timeout=60)
    assert ep.plan.epoch == 1 and checks[0] >= 2


class _Coordinator:
    """Fails each run with the next of ``errors`` (None: the run finishes)."""

    def __init__(self, errors: list[BaseException | None]) -> None:
        self.errors = errors
        self.drives = 0
        self.failed: list[BaseException] = []

    def _fail_all(self, exc: BaseException) -> None:  # what Epochs.end calls on its coordinator
        self.failed.append(exc)

    async def drive(self, run: Any) -> None:
        self.drives += 1
        err = self.errors.pop(0)
        if err is not None:
            raise err
        run.decoder.output_ids.append(99)


def _run() -> Any:
    return SimpleNamespace(decoder=SimpleNamespace(output_ids=[1, 2, 3]), fed_log=[object()] * 4)


async def test_a_failed_ring_ends_its_epoch_and_the_run_resumes_on_the_next(autojump_clock: trio.testing.MockClock) -> None:
    epochs = _epochs()
    first = _take(epochs, _plan(3, ring=("A", "B")), serving=True)
    first.compiled = {"B": {"spans": [64], "eager_from": 64, "eager": None, "dtype": "bf16"}}
    coord = _Coordinator([PeerLost("B went away")])
    first.coordinator = coord  # type: ignore[assignment]
    resumer, faults = _resumer(epochs)
    run, replans, told = _run(), list[dict[str, Any]](), list[str]()

    async def replan() -> None:
        await trio.sleep(1)
        assert not first.live  # the run's own failure ended the epoch it ran on
        second = _take(epochs, _plan(4, ring=("A", "D")), serving=True)
        second.cause = "peer B is lost"
        second.coordinator = _Coordinator([None])  # type: ignore[assignment]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(replan)
        done = await resumer.drive(first, run, replans, [0.0], told.append)
    assert done.plan.epoch == 4 and run.decoder.output_ids == [1, 2, 3, 99]
    assert [str(e) for e in coord.failed] == ["epoch 3 ended: a generation on epoch 3 failed: B went away"]
    assert faults == []  # a lost peer is not reported as faulty
    assert "epoch 3 failed: B went away" in epochs.end_reason
    (rec,) = replans
    assert (rec["from_epoch"], rec["to_epoch"], rec["lost"], rec["cause"]) == (3, 4, ["B"], "peer B is lost")
    assert (rec["blocks_changed"], rec["replayed_chunks"], rec["resumed_at_token"]) == ({"D": [3, 6]}, 4, 3)
    assert rec["compiled"] == first.compiled  # how the ring it left ran: the receipt's replay note reads it
    assert told[0].startswith("paused after 3 tokens: B went away")
    assert told[-1].startswith("resuming on epoch 4") and "replaying 4 chunks" in told[-1]


async def test_a_faulty_peer_is_reported_and_a_moved_coordinator_takes_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    epochs = _epochs()
    first = _take(epochs, _plan(5), serving=True)
    first.compiled = {"B": {"spans": [64], "eager_from": 64, "eager": None, "dtype": "bf16"}}
    first.coordinator = _Coordinator([FaultyPeer("B", "NaN in hidden states")])  # type: ignore[assignment]
    resumer, faults = _resumer(epochs)

    async def replan() -> None:
        await trio.sleep(1)
        _take(epochs, _plan(6, coord="A", ring=("A",)), serving=False)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(replan)
        with pytest.raises(CoordinatorMoved) as info:
            await resumer.drive(first, _run(), [], [0.0])
    assert faults == [("B", "NaN in hidden states", 5)]
    assert info.value.coordinator == "A" and info.value.epoch.plan.epoch == 6 and info.value.ran == first.compiled
