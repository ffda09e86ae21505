"""The leader's bench (node/plan/bench.py), on a mock clock: strikes within the window bench a
member, which then stays out of plans for EXCLUDE_S and ends the epoch if it is in the ring;
never this node itself, never twice. The view is the real MemberView over a small membership
fake (as in test_view.py), the epochs a standby's (test_epochs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from swarm.node.members.failure import FailureDetector
from swarm.node.members.view import MemberView
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.authority import EXCLUDE_S, STRIKES
from swarm.node.plan.bench import Bench
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan

ME = "L"


class _Service:
    def __init__(self, live: list[str]) -> None:
        adverts = {p: SimpleNamespace(memory_bytes=1 << 30) for p in live}
        self.membership = SimpleNamespace(view=lambda: dict(adverts), get=adverts.get)
        self.liveness = SimpleNamespace(detector=FailureDetector())
        self.live = live

    def members(self) -> list[str]:
        return list(self.live)


def _bench(ring: tuple[str, ...] = ("A", "B")) -> tuple[Bench, MemberView, Epoch, list[Epoch]]:
    view = MemberView(ME, _Service(["A", "B", "D"]), SimpleNamespace(is_admitted=lambda p: True))  # type: ignore[arg-type]
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    ended: list[Epoch] = []
    epochs = Epochs(settings, ME, None, SlotQueue(), Notices(Hooks()), leader=lambda: ME, memory=dict,  # type: ignore[arg-type]
                    on_end=ended.append)  # fmt: skip
    ep = Epoch(Plan(2, 6, ME, ring, {p: (3 * i, 3 * i + 3) for i, p in enumerate(ring)}, (), 1.0, 1.0), b"")
    epochs.current = ep
    return Bench(ME, view, epochs), view, ep, ended


async def test_strikes_within_the_window_bench_a_ring_member_and_end_its_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bench, view, ep, ended = _bench()
    for i in range(STRIKES - 1):
        bench.strike("B", f"ended too often ({i})")
        await trio.sleep(10)
    assert "B" in view.plannable() and ep.live
    bench.strike("B", "forced an epoch end")
    assert view.plannable() == ["A", "D", ME] and ended == [ep]
    assert bench.epochs.end_reason.startswith(f"peer B misbehaved: {STRIKES} strikes within {EXCLUDE_S:.0f} s")
    assert bench.epochs.end_reason.endswith("the last: forced an epoch end")
    assert view.excluded["B"] == trio.current_time() + EXCLUDE_S
    await trio.sleep(EXCLUDE_S)
    assert "B" in view.plannable()  # benched for EXCLUDE_S, then planned again


async def test_strikes_spread_wider_than_the_window_never_bench(autojump_clock: trio.testing.MockClock) -> None:
    bench, view, ep, ended = _bench()
    for _ in range(3 * STRIKES):
        bench.strike("A", "ended too often")
        await trio.sleep(EXCLUDE_S / (STRIKES - 1) + 1)
    assert "A" in view.plannable() and ep.live and ended == []


async def test_never_this_node_and_never_a_benched_peer_twice(autojump_clock: trio.testing.MockClock) -> None:
    bench, view, ep, ended = _bench(ring=(ME, "A"))
    for _ in range(STRIKES + 1):
        bench.strike(ME, "a report about the leader itself")
    assert ME in view.plannable() and ep.live
    bench.bench("D", "bad activations")  # not in the ring: out of plans, the ring goes on
    until = view.excluded["D"]
    assert ep.live and "D" not in view.plannable()
    await trio.sleep(60)
    for _ in range(STRIKES):
        bench.strike("D", "ended too often")
    assert view.excluded["D"] == until  # strikes against a benched peer change nothing
    assert bench.strikes.strike("D", trio.current_time()) == 1  # ... and were not even counted
    assert ended == []
