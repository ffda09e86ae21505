"""Who may send what on the ring protocol, and what a lone accusation is worth (issue 14)."""

from __future__ import annotations

import pytest

from swarm.errors import ProtocolError
from swarm.node.authority import (
    MAX_EPOCH_STEP,
    FaultClaims,
    check_epoch_step,
    check_fault_report,
    upstreams_of,
)
from swarm.planner import Plan


def _plan(coord: str = "C", ring: tuple[str, ...] = ("A", "B", "D")) -> Plan:
    blocks = {p: (3 * i, 3 * i + 3) for i, p in enumerate(ring)}
    return Plan(7, 3 * len(ring), coord, ring, blocks, (), 1.0, 1.0)


def test_upstreams_follow_the_ring() -> None:
    plan = _plan()
    assert upstreams_of(plan, "A") == {"C"}
    assert upstreams_of(plan, "B") == {"A"}
    assert upstreams_of(plan, "C") == {"D"}  # the tail returns to the coordinator
    assert upstreams_of(plan, "X") == set()
    both = _plan(coord="A", ring=("A", "B"))  # a coordinator that also holds the first block
    assert upstreams_of(both, "A") == {"B"}


def test_only_the_receiving_end_may_report_a_hop() -> None:
    plan = _plan()
    check_fault_report(plan, "B", "A", 7)
    check_fault_report(plan, "C", "D", 7)
    with pytest.raises(ProtocolError, match="only its own upstream"):
        check_fault_report(plan, "B", "C", 7)  # framing the coordinator
    with pytest.raises(ProtocolError, match="only its own upstream"):
        check_fault_report(plan, "X", "A", 7)  # a client that holds no hop
    with pytest.raises(ProtocolError, match="epoch 6"):
        check_fault_report(plan, "B", "A", 6)


def test_epoch_step_bound() -> None:
    check_epoch_step(5 + MAX_EPOCH_STEP, 5, "x")
    with pytest.raises(ProtocolError, match="more than"):
        check_epoch_step(1 << 62, 5, "ended from M")


def test_one_accuser_benches_both_ends_two_confirm() -> None:
    claims = FaultClaims(window=300.0)
    v = claims.report("B", "A", leader="L", now=0.0, spare_both=True)
    assert sorted(v.bench) == ["A", "B"] and "alone" in v.why
    v = claims.report("D", "A", leader="L", now=10.0, spare_both=True)  # a second party agrees
    assert v.bench == ["A"] and "B" in v.why and "D" in v.why
    v = claims.report("L", "Z", leader="L", now=11.0, spare_both=True)  # the leader's own eyes
    assert v.bench == ["Z"]


def test_a_serial_accuser_is_benched_instead_of_its_next_victim() -> None:
    claims = FaultClaims(window=300.0)
    assert claims.report("M", "A", leader="L", now=0.0, spare_both=False).bench == ["A"]
    v = claims.report("M", "C", leader="L", now=5.0, spare_both=False)
    assert v.bench == ["M"], v
    # after the window the slate is clean
    assert claims.report("M", "C", leader="L", now=400.0, spare_both=False).bench == ["C"]


def test_claims_stay_bounded() -> None:
    claims = FaultClaims(window=1e9, max_entries=16)
    for i in range(100):
        claims.report(f"acc{i}", f"peer{i}", leader="L", now=float(i), spare_both=True)
    assert len(claims._claims) <= 16


class _Standby:
    """Just enough of a Node for EpochRole._accept_plan: a standby with no block."""

    def __init__(self, leader_identity: object) -> None:
        from types import SimpleNamespace

        self.settings = SimpleNamespace(swarm_id="friends")
        self.epoch = None
        self._newest_plan = (0, None)
        self._cut_off_since = None
        self.peer_id = "standby"
        self._leader = leader_identity.peer_id  # type: ignore[attr-defined]
        self.ended: list[str] = []
        self.events: list[str] = []
        self._epoch_ended_at = 0.0

    def leader(self) -> str:
        return self._leader

    def life(self, event: str, **fields: object) -> None:
        self.events.append(event)

    def _end_epoch(self, reason: str, *, only: object = None) -> None:
        assert self.epoch is not None
        self.epoch.done.set()
        self.ended.append(reason)


async def test_an_old_plan_is_refused_after_the_newer_epoch_ends() -> None:
    """A replayed plan of an earlier epoch, validly signed by the leader, is never taken again,
    not even once the newer epoch has ended (epoch.py ``_newest_plan``)."""
    from swarm.manifest.identity import Identity
    from swarm.node.epoch import EpochRole, plan_body
    from swarm.proto.messages import Plan as PlanMsg
    from swarm.proto.signed import sign_plan

    leader = Identity.generate()
    node = _Standby(leader)

    def signed(epoch: int) -> PlanMsg:
        p = _plan()
        p = Plan(epoch, p.n_layers, p.coordinator, p.ring, p.blocks, p.standbys, 1.0, 1.0)
        return sign_plan(PlanMsg(epoch, plan_body(p, "test")), leader, "friends")

    old, new = signed(3), signed(4)
    await EpochRole._accept_plan(node, "L", old)  # type: ignore[arg-type]
    await EpochRole._accept_plan(node, "L", new)  # type: ignore[arg-type]
    node._end_epoch("lost a peer")  # the newer epoch ends
    with pytest.raises(ProtocolError, match="epoch 4 was planned already"):
        await EpochRole._accept_plan(node, "M", old)  # type: ignore[arg-type]
    other_swarm = sign_plan(PlanMsg(5, plan_body(_plan(), "x")), leader, "another-swarm")
    with pytest.raises(ProtocolError, match="forged"):
        await EpochRole._accept_plan(node, "M", other_swarm)  # type: ignore[arg-type]
    assert node.epoch is not None and node.epoch.plan.epoch == 4
