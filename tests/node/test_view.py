"""This node's view (node/members/view.py): leader election, who may be planned, and the kick
that wakes the leader loop, on a mock clock. The membership service under it is a small fake
(a real FailureDetector, adverts as a dict): the real service is covered by test_membership.py
and every in-memory swarm test."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import trio
import trio.testing

from swarm.node.members.failure import FailureDetector
from swarm.node.members.view import MemberView


@dataclass
class _Membership:
    adverts: dict[str, object] = field(default_factory=dict)

    def view(self) -> dict[str, object]:
        return dict(self.adverts)

    def get(self, peer: str) -> object | None:
        return self.adverts.get(peer)


class _Service:
    """What MemberView reads of MembershipService: live members, adverts, the detector."""

    def __init__(self, live: list[str], advertised: list[str]) -> None:
        self.live = live
        self.membership = _Membership({p: SimpleNamespace(memory_bytes=1 << 20) for p in advertised})
        self.liveness = SimpleNamespace(detector=FailureDetector())

    def members(self) -> list[str]:
        return list(self.live)


class _Host:
    def __init__(self, admitted: set[str]) -> None:
        self.admitted = admitted

    def is_admitted(self, peer: str) -> bool:
        return peer in self.admitted


def _view(me: str = "c", live: tuple[str, ...] = ("a", "b", "d"), advertised: tuple[str, ...] = ("a", "b", "c", "d")) -> MemberView:
    return MemberView(me, _Service(list(live), list(advertised)), _Host(set(live)))  # type: ignore[arg-type]


def test_members_are_the_live_advertised_peers_and_this_node() -> None:
    view = _view(live=("a", "b", "x"), advertised=("a", "b", "c"))  # x never advertised: a client
    assert view.members() == ["a", "b", "c"]
    assert view.admitted_role("a") == "member" and view.admitted_role("x") == "client"
    assert view.admitted_role("nobody") is None
    assert view.memory() == {p: 1 << 20 for p in "abc"}


def test_the_leader_is_the_smallest_member_not_leaving() -> None:
    view = _view()
    assert view.leader() == "a"
    view.leaving.add("a")
    assert view.leader() == "b"
    view.leaving |= {"b", "c", "d"}
    assert view.leader() == "a", "every member leaving: the smallest of them"


def test_a_peer_not_heard_from_is_a_suspect_until_lost() -> None:
    view = _view()
    det = view.service.liveness.detector
    for p in ("a", "b", "d"):
        det.heard(p, 0.0)
    later = det.suspect_after + 0.1
    det.heard("a", later)
    det.heard("b", later)
    det.tick(later)
    assert view.suspects() == ["d"]
    det.heard("a", det.lost_after + 0.1)
    det.heard("b", det.lost_after + 0.1)
    det.tick(det.lost_after + 0.1)
    assert view.suspects() == [], "a lost peer is no longer a suspect"


async def test_plannable_leaves_out_leaving_and_excluded_until_their_deadline(autojump_clock: trio.testing.MockClock) -> None:
    view = _view()
    view.leaving.add("b")
    view.exclude("d", 10.0)
    assert view.plannable() == ["a", "c"]
    await trio.sleep(10.0)
    assert view.plannable() == ["a", "c", "d"], "an exclusion ends at its deadline"
    view.exclude("a", 5.0)
    assert set(view.excluded) == {"a"}, "expired exclusions are dropped when another is added"


async def test_kick_wakes_a_waiter_once_and_changed_times_out_otherwise(autojump_clock: trio.testing.MockClock) -> None:
    view = _view()
    woke: list[float] = []

    async def waiter() -> None:
        await view.changed(timeout=30.0)
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(2.0)
        view.kick()
    assert woke == [2.0]
    start = trio.current_time()
    await view.changed(timeout=3.0)  # the earlier kick is not left set: this waits it out
    assert trio.current_time() - start == 3.0
