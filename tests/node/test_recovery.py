"""When the ring loses a peer (node/plan/recovery.py), branch by branch on a mock clock: a lost
ring member ends the epoch, a node left alone marks itself cut off, a member whose ring ended
nudges a leader that plans nothing, bad bytes and bad activations reach the leader (or are
weighed by it), and leaving on purpose, from both ends. The view is the real MemberView over a
membership fake, the epochs a standby's, the bench the real one; the leader is a fake of what
Recovery asks of it (planning problem, a trial plan, being cut off) and the ring client records
requests and answers as a test says. Whole swarms losing peers: test_swarm_mem.py."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import PeerError, PeerTimeout, PlanningError, ProtocolError
from swarm.node.members.failure import FailureDetector
from swarm.node.members.gossip import MemberEvent
from swarm.node.members.view import MemberView
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.authority import EXCLUDE_S
from swarm.node.plan.bench import Bench
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.plan.recovery import LEAVE_TIMEOUT_S, NUDGE_AFTER_S, Recovery
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto import control as ctl
from swarm.proto.messages import Message


class _Service:
    def __init__(self, live: list[str]) -> None:
        self.live = live
        adverts = {p: SimpleNamespace(memory_bytes=1 << 30) for p in "ABCDL"}
        self.membership = SimpleNamespace(view=lambda: dict(adverts), get=adverts.get)
        self.liveness = SimpleNamespace(detector=FailureDetector())

    def members(self) -> list[str]:
        return list(self.live)


class _Leader:
    def __init__(self, view: MemberView, epochs: Epochs) -> None:
        self.cut_off_since: float | None = None
        self.benches = Bench(view.peer_id, view, epochs)
        self.problem: str | None = None
        self.trial: Callable[[list[str]], None] = lambda members: None

    def cut_off(self) -> None:
        self.cut_off_since = trio.current_time()

    def planning_problem(self) -> str | None:
        return self.problem

    def plan_for(self, members: list[str], previous: Plan | None, epoch: int) -> Plan:
        self.trial(members)
        assert previous is not None
        return previous


@dataclass
class _Ring:
    """Records requests; answers each with ``answer(peer, msg)`` (default: Ack)."""

    calls: list[tuple[float, str, Message]] = field(default_factory=list)
    answer: Callable[[str, Message], Any] = lambda peer, msg: ctl.Ack()

    async def call(self, peer: str, msg: Message, timeout: float = 20.0) -> Message:
        self.calls.append((trio.current_time(), peer, msg))
        reply = self.answer(peer, msg)
        if isinstance(reply, BaseException):
            raise reply
        if reply == "hang":
            await trio.sleep_forever()
        return reply  # type: ignore[no-any-return]


@dataclass
class _Node:
    rec: Recovery
    view: MemberView
    epochs: Epochs
    leader: _Leader
    ring: _Ring
    live: list[str]
    life: list[dict[str, Any]]
    notices: list[str]


def _plan(epoch: int, coord: str = "A", ring: tuple[str, ...] = ("A", "B", "C")) -> Plan:
    return Plan(epoch, 3 * len(ring), coord, ring, {p: (3 * i, 3 * i + 3) for i, p in enumerate(ring)}, (), 1.0, 1.0)


def _serve(n: _Node, plan: Plan) -> Epoch:
    """``plan`` becomes the serving epoch here (as Epochs.accept and the set-up leave it)."""
    if n.epochs.current is not None:
        n.epochs.end(f"replaced by epoch {plan.epoch}")
    ep = Epoch(plan, b"")
    n.epochs.previous, n.epochs.current = n.epochs.current, ep
    n.epochs.mark_serving(ep)  # wakes Epochs.wait_for's waiters
    return ep


@asynccontextmanager
async def _node(me: str, live: tuple[str, ...] = ("A", "B", "C", "D")) -> AsyncIterator[_Node]:
    service = _Service([p for p in live if p != me])
    view = MemberView(me, service, SimpleNamespace(is_admitted=lambda p: True))  # type: ignore[arg-type]
    life: list[dict[str, Any]] = []
    shown: list[str] = []
    notices = Notices(Hooks(on_event=shown.append, on_life=life.append))
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    ends, ended = trio.open_memory_channel[Epoch](math.inf)  # as serving.py wires them
    epochs = Epochs(settings, me, None, SlotQueue(), notices, leader=view.leader, memory=dict, on_end=ends.send_nowait)  # type: ignore[arg-type]
    leader = _Leader(view, epochs)
    ring = _Ring()
    async with trio.open_nursery() as nursery:
        rec = Recovery(view, epochs, leader, ring, notices, nursery, ended=ended)  # type: ignore[arg-type]
        nursery.start_soon(rec.run)
        yield _Node(rec, view, epochs, leader, ring, service.live, life, shown)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- losses


async def test_a_lost_ring_member_ends_the_epoch_and_a_lost_standby_does_not(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("B") as n:
        ep = _serve(n, _plan(3))
        n.view.leaving.add("D")
        n.live.remove("D")
        n.rec.member_event(MemberEvent("lost", "D"))
        assert ep.live and "D" not in n.view.leaving  # a standby: the ring goes on; if D comes back, it is a member
        n.rec.member_event(MemberEvent("suspect", "C"))
        assert ep.live
        n.rec.member_event(MemberEvent("lost", "C", reason="3 beats missed"))
        assert not ep.live and n.epochs.end_reason == "ring member C lost (3 beats missed)"
        assert n.leader.cut_off_since is None  # others remain


async def test_a_node_every_other_member_left_marks_itself_cut_off_once(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("B", live=("A", "B")) as n:
        await trio.sleep(5)
        n.live.clear()
        n.rec.member_event(MemberEvent("left", "A"))
        assert n.leader.cut_off_since == 5.0
        await trio.sleep(5)
        n.rec.member_event(MemberEvent("lost", "A"))
        assert n.leader.cut_off_since == 5.0  # since the first time it found itself alone
        n.rec.stalled(12.5)
        assert n.leader.cut_off_since == 10.0 and "stopped for 12.5 s" in n.notices[-1]


async def test_a_member_whose_ring_ended_nudges_a_leader_that_plans_nothing(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("B") as n:
        _serve(n, _plan(3))
        n.epochs.end("lost C")
        await trio.sleep(NUDGE_AFTER_S + 0.1)
        assert [(t, p, m) for t, p, m in n.ring.calls] == [(NUDGE_AFTER_S, "A", ctl.Ended(3))]
        _serve(n, _plan(4, ring=("A", "B")))
        n.epochs.end("lost B")  # this time a new plan comes before the nudge is due
        await trio.sleep(1)
        _serve(n, _plan(5, ring=("A", "D")))
        await trio.sleep(NUDGE_AFTER_S)
        assert len(n.ring.calls) == 1


async def test_the_leader_itself_never_nudges(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("A") as n:
        _serve(n, _plan(3))
        n.epochs.end("lost C")
        await trio.sleep(2 * NUDGE_AFTER_S)
        assert n.ring.calls == []


# ---------------------------------------------------------------- faults and bad bytes


async def test_bad_activations_are_reported_to_the_leader_and_a_refusal_only_logged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _node("C") as n:
        n.ring.answer = lambda peer, msg: ctl.Fail("forbidden", "not your upstream")
        await n.rec.report_fault("B", "NaN in hidden states", 3)
        assert [(p, m) for _, p, m in n.ring.calls] == [("A", ctl.Fault("B", 3, "NaN in hidden states"))]
        assert "peer B sent bad activations" in n.notices[-1]
        n.ring.answer = lambda peer, msg: "hang"
        await n.rec.report_fault("B", "again", 3)  # best effort: bounded, never raises
        assert trio.current_time() == pytest.approx(20.0)


async def test_the_leader_weighs_a_fault_report_about_a_known_epoch_only(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("A") as n:
        _serve(n, _plan(3, coord="A", ring=("B", "C", "D")))
        trial: list[list[str]] = []
        n.leader.trial = trial.append
        with pytest.raises(ProtocolError, match="neither the current epoch here nor the last"):
            n.rec.fault_report("C", "B", 2, "NaN")
        n.rec.fault_report("C", "B", 3, "NaN")  # a lone accusation: the ring without both is tried
        assert trial == [["A", "D"]]
        n.rec.fault_report("A", "D", 3, "NaN")  # the coordinator's own evidence (D is its upstream)
        assert "D" not in n.view.plannable() and not n.epochs.current.live  # type: ignore[union-attr]
    async with _node("B") as m:
        with pytest.raises(ProtocolError, match="B is not the leader; ask A"):
            m.rec.fault_report("C", "D", 3, "NaN")


async def test_bad_bytes_seen_by_the_leader_bench_at_once_and_a_members_word_is_one_strike(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _node("A") as n:
        await n.rec.report_bad_bytes("D", "sha256 mismatch in layer 3")
        assert "D" not in n.view.plannable() and n.view.excluded["D"] == EXCLUDE_S
        assert n.ring.calls == []  # the leader's own report goes nowhere
        for _ in range(2):
            await n.rec.on_bad_bytes("B", ctl.BadBytes("C", "bad bytes"))  # the same accuser, twice
        assert n.leader.benches.strikes.strike("C", trio.current_time()) == 2  # one heard, plus this
        await n.rec.on_bad_bytes("B", ctl.BadBytes("B", "myself"))
        await n.rec.on_bad_bytes("B", ctl.BadBytes("A", "the leader"))
        assert "B" in n.view.plannable() and "A" in n.view.plannable()  # nobody self-accuses; the leader stays
    async with _node("C") as m:
        m.ring.answer = lambda peer, msg: PeerError("A is gone")
        await m.rec.report_bad_bytes("B", "sha256 mismatch")  # best effort
        assert [(p, msg) for _, p, msg in m.ring.calls] == [("A", ctl.BadBytes("B", "sha256 mismatch"))]
        with pytest.raises(ProtocolError, match="not the leader"):
            m.rec.bad_bytes_report("D", "B", "x")


# ---------------------------------------------------------------- leaving on purpose


async def test_leaving_alone_or_from_outside_the_ring_hands_nothing_over(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("A", live=("A",)) as n:
        await n.rec.leave()
        assert n.life[-1] == {"event": "handover", "result": "alone: nobody to hand over to"} and n.ring.calls == []
    async with _node("D") as n:
        _serve(n, _plan(3))
        n.ring.answer = lambda peer, msg: "hang" if peer == "C" else ctl.Ack()  # C never answers
        await n.rec.leave()
        told = sorted(p for _, p, m in n.ring.calls if isinstance(m, ctl.Leaving))
        assert told == ["A", "B", "C"] and trio.current_time() <= LEAVE_TIMEOUT_S
        assert n.life[0] == {"event": "leaving", "in_ring": False, "members": 3}
        assert n.life[-1]["result"] == "not in the ring: nothing to hand over"


async def test_a_leaving_ring_member_asks_the_leader_and_reports_how_it_went(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("B") as n:
        _serve(n, _plan(3))
        await n.rec.leave()
        assert [p for _, p, m in n.ring.calls if isinstance(m, ctl.Leave)] == ["A"]
        assert n.life[-1] == {"event": "handover", "result": "done", "leader": "A"}
    async with _node("B") as n:
        _serve(n, _plan(3))
        n.ring.answer = lambda peer, msg: ctl.Fail("cannot_serve", "2 GB short") if isinstance(msg, ctl.Leave) else ctl.Ack()
        await n.rec.leave()
        assert n.life[-1]["result"].startswith("failed: the leader refused our leave: 2 GB short")
    async with _node("B") as n:
        _serve(n, _plan(3))
        n.ring.answer = lambda peer, msg: "hang" if isinstance(msg, ctl.Leave) else ctl.Ack()
        await n.rec.leave(timeout=4.0)
        assert n.life[-1]["result"] == "timed out after 4 s" and trio.current_time() == pytest.approx(4.0)
    async with _node("A", live=("A", "B")) as n:  # the leader leaving when the only other member leaves too
        _serve(n, _plan(3, ring=("A", "B")))
        n.view.leaving.add("B")
        await n.rec.leave()
        assert n.life[-1]["result"] == "every member is leaving"


async def test_the_leader_answers_a_leave_once_a_ring_without_the_leaver_serves(autojump_clock: trio.testing.MockClock) -> None:
    async with _node("A") as n:
        ep = _serve(n, _plan(3))

        async def replan() -> None:
            await trio.sleep(1.5)
            _serve(n, _plan(4, ring=("A", "C", "D")))

        n.rec.nursery.start_soon(replan)
        assert isinstance(await n.rec.on_leave("B", ctl.Leave()), ctl.Ack)
        assert not ep.live and n.epochs.end_reason.startswith("peer B is leaving")
        assert trio.current_time() == pytest.approx(1.5, abs=0.1) and "B" in n.view.leaving
        with pytest.raises(PeerTimeout, match="no ring without C"):
            await n.rec.on_leave("C", ctl.Leave())  # nobody re-plans here: the leaver stops waiting too
        assert trio.current_time() == pytest.approx(1.5 + LEAVE_TIMEOUT_S, abs=0.1)
        n.leader.problem = "1.5 GB missing"
        with pytest.raises(PlanningError, match="cannot re-plan without D: 1.5 GB missing"):
            await n.rec.on_leave("D", ctl.Leave())
        assert "D" not in n.view.leaving  # refused: D stays a member to plan with
        n.view.leaving.add("A")
        with pytest.raises(PeerError, match="A is leaving too"):
            await n.rec.on_leave("D", ctl.Leave())
    async with _node("C") as m:
        with pytest.raises(ProtocolError, match="not the leader"):
            await m.rec.on_leave("B", ctl.Leave())
        assert isinstance(await m.rec.on_leaving("D", ctl.Leaving()), ctl.Ack) and "D" not in m.view.plannable()
