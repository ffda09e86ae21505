"""Who may send what on the ring protocol, and what a lone accusation is worth (issue 14)."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.errors import PlanningError, ProtocolError
from swarm.node.plan.authority import (
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


def _standby_epochs(leader_id: str) -> tuple[object, list[str]]:
    """The real epoch state of a standby (no block: nothing to load) whose leader is ``leader_id``."""
    from swarm.node.notices import Hooks, Notices
    from swarm.node.plan.epochs import Epochs
    from swarm.node.ring.capacity import SlotQueue
    from swarm.node.settings import NodeSettings

    events: list[str] = []
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    notices = Notices(Hooks(on_life=lambda ev: events.append(ev["event"])))
    epochs = Epochs(settings, "standby", None, SlotQueue(), notices, leader=lambda: leader_id,  # type: ignore[arg-type]
                    memory=dict)  # fmt: skip
    return epochs, events


async def test_an_old_plan_is_refused_after_the_newer_epoch_ends() -> None:
    """A replayed plan of an earlier epoch, validly signed by the leader, is never taken again,
    not even once the newer epoch has ended (epochs.py ``Epochs.newest``)."""
    from swarm.manifest.identity import Identity
    from swarm.node.plan.epochs import plan_body
    from swarm.proto.messages import Plan as PlanMsg
    from swarm.proto.signed import sign_plan

    leader = Identity.generate()
    epochs, events = _standby_epochs(leader.peer_id)

    def signed(epoch: int) -> PlanMsg:
        p = _plan()
        p = Plan(epoch, p.n_layers, p.coordinator, p.ring, p.blocks, p.standbys, 1.0, 1.0)
        return sign_plan(PlanMsg(epoch, plan_body(p, "test")), leader, "friends")

    old, new = signed(3), signed(4)
    await epochs.accept("L", old)  # type: ignore[attr-defined]
    await epochs.accept("L", new)  # type: ignore[attr-defined]
    epochs.end("lost a peer")  # type: ignore[attr-defined]  # the newer epoch ends
    with pytest.raises(ProtocolError, match="epoch 4 was planned already"):
        await epochs.accept("M", old)  # type: ignore[attr-defined]
    other_swarm = sign_plan(PlanMsg(5, plan_body(_plan(), "x")), leader, "another-swarm")
    with pytest.raises(ProtocolError, match="forged"):
        await epochs.accept("M", other_swarm)  # type: ignore[attr-defined]
    assert epochs.current is not None and epochs.current.plan.epoch == 4  # type: ignore[attr-defined]
    assert events == ["plan", "replan", "plan", "replan"]  # taken twice, each ended once


async def test_a_plan_not_signed_by_the_leader_here_is_refused() -> None:
    from swarm.manifest.identity import Identity
    from swarm.node.plan.epochs import plan_body
    from swarm.proto.messages import Plan as PlanMsg
    from swarm.proto.signed import sign_plan

    leader, other = Identity.generate(), Identity.generate()
    epochs, _ = _standby_epochs(leader.peer_id)
    with pytest.raises(ProtocolError, match="but the leader here is"):
        await epochs.accept("M", sign_plan(PlanMsg(3, plan_body(_plan(), "x")), other, "friends"))  # type: ignore[attr-defined]
    took = await epochs.accept("M", sign_plan(PlanMsg(3, plan_body(_plan(), "x")), other, "friends"),  # type: ignore[attr-defined]
                               catching_up=True)  # fmt: skip
    assert took.plan.epoch == 3  # a peer catching up takes a plan its view's leader did not sign


class _View:
    """The dispatcher's view of roles: members M1, M2 (leader M1), client C, an outsider X."""

    peer_id = "ME"

    def admitted_role(self, peer: str) -> str | None:
        return {"M1": "member", "M2": "member", "C": "client"}.get(peer)

    def members(self) -> list[str]:
        return ["M1", "M2", "ME"]

    def leader(self) -> str:
        return "M1"


def _epoch_roles(epoch: int) -> tuple[str | None, set[str]]:
    if epoch == 7:  # the current epoch
        return "M1", {"M1", "M2"}
    if epoch == 6:  # the one it replaced: its stages may still report a fault in it
        return None, {"M2"}
    raise ProtocolError(f"epoch {epoch} is not current here (current: 7)")


async def test_the_dispatch_table_checks_every_role_before_the_handler() -> None:
    from swarm.node.dispatch import ROLES, Dispatcher
    from swarm.proto import control as ctl
    from swarm.proto.messages import Plan as PlanMsg

    handled: list[str] = []

    async def handler(peer: str, msg: object) -> ctl.Control:
        handled.append(f"{type(msg).__name__}:{peer}")
        return ctl.Ack()

    table = Dispatcher(_View(), _epoch_roles, {t: handler for t in ROLES}, "test")
    cases = [  # (message, sender, refused with)
        (PlanMsg(7, {}), "M2", "only the leader M1"), (PlanMsg(7, {}), "M1", None),
        (ctl.Connect(7), "M2", "only the plan's signer M1"), (ctl.Connect(7), "M1", None),
        (ctl.Serve(7), "C", "only the plan's signer"), (ctl.Connect(6), "M1", "epoch 6 is not current"),
        (ctl.Fault("M1", 6), "M2", None), (ctl.Fault("M2", 6), "M1", "only its own upstream hop"),
        (ctl.Fault("M2", 5), "M1", "epoch 5 is not current"),
        (ctl.Fault("M2", 7), "M1", None), (ctl.Fault("M2", 7), "C", "only its own upstream hop"),
        (ctl.Ended(7), "C", "not an advertised member"), (ctl.Leave(), "M2", None), (ctl.Leaving(), "C", "member"),
        (ctl.Current(), "C", "not an advertised member"), (ctl.Current(), "M2", None),
        (ctl.Gen.checked([1]), "C", None), (ctl.Status(), "C", None), (ctl.Status(), "X", "not admitted"),
        (ctl.Leave(), "ME", None),  # our own request, in-process (the leader's own phases)
        (ctl.BadBytes("M2", "sha256"), "M1", None), (ctl.BadBytes("M2"), "C", "not an advertised member"),
        (ctl.BadBytes("M1"), "X", "not admitted"),
    ]  # fmt: skip
    for msg, sender, refused in cases:
        reply = await table(sender, msg)
        if refused is None:
            assert isinstance(reply, ctl.Ack), (msg, sender, reply)
        else:
            assert isinstance(reply, ctl.Fail) and refused in reply.message, (msg, sender, reply)
            assert reply.code == ("bad_request" if "not current" in refused else "forbidden"), reply
    assert len(handled) == sum(r is None for _, _, r in cases)
    unexpected = await Dispatcher(_View(), _epoch_roles, {}, "test")("M1", ctl.Ack())
    assert isinstance(unexpected, ctl.Fail) and "unexpected Ack" in unexpected.message
    with pytest.raises(TypeError, match="no role declared"):
        Dispatcher(_View(), _epoch_roles, {ctl.Done: handler}, "test")


def test_a_peer_s_role_comes_from_the_host_when_it_can_tell() -> None:
    from types import SimpleNamespace

    from swarm.node.dispatch import role_of

    old = SimpleNamespace(is_admitted=lambda p: p != "X")  # today's host: advertised peers are members
    assert role_of(old, "A", advertised=True) == "member" and role_of(old, "C", advertised=False) == "client"
    assert role_of(old, "X", advertised=True) is None
    new = SimpleNamespace(is_admitted=lambda p: True, admitted_role=lambda p: "client")  # a lesser credential
    assert role_of(new, "A", advertised=True) == "client"


def test_a_catch_up_takes_only_plans_signed_by_a_leader_verified_and_held_beyond_their_signer() -> None:
    """Issue 27: a member's own "previous plan" (unsigned, or signed by itself and shown by it
    alone) never decides the next plan; the interim leader's plan, held by its ring, does."""
    import dataclasses
    import os

    from swarm.manifest.identity import Identity
    from swarm.node.plan.authority import vouched_plans
    from swarm.proto.messages import Plan as PlanMsg
    from swarm.proto.signed import sign_plan

    me, interim, rogue = (Identity(os.urandom(32)) for _ in range(3))
    body = {"coordinator": "x", "ring": ["x"]}
    honest = sign_plan(PlanMsg(8, body), interim, "sw")
    mine = sign_plan(PlanMsg(7, body), me, "sw")
    by_rogue = sign_plan(PlanMsg(9, body), rogue, "sw")

    def take(shown: list[tuple[str, PlanMsg]], leaders: set[str] | None = None) -> list[int]:
        taken, _why = vouched_plans(shown, leaders=leaders or {interim.peer_id, me.peer_id}, me=me.peer_id,
                                    swarm_id="sw", newest_known=7)  # fmt: skip
        return sorted(m.epoch for m in taken)

    assert take([("A", PlanMsg(9, body))]) == []  # unsigned
    assert take([(rogue.peer_id, by_rogue), ("A", by_rogue)]) == []  # not a leader here
    assert take([(interim.peer_id, honest)]) == []  # held by its signer alone
    assert take([(interim.peer_id, honest), ("A", honest)]) == [8]  # ... and by a member of its ring
    assert take([("A", mine)]) == [7]  # ours: nobody else can sign it
    assert take([("A", dataclasses.replace(honest, plan={"coordinator": "evil"})), ("B", honest)]) == [8]  # tampered
    assert take([("A", sign_plan(PlanMsg(7 + 10_001, body), interim, "sw")), ("B", honest)]) == [8]  # too far
    assert take([("A", sign_plan(PlanMsg(8, body), interim, "other")), ("B", honest)]) == [8]  # another swarm
    # the rogue that sorts right after the leader is the interim leader of a thawed one: still alone
    assert take([(rogue.peer_id, by_rogue)], {rogue.peer_id, me.peer_id}) == []


def test_strikes_hear_one_ended_per_interval_and_reach_the_bench_limit() -> None:
    from swarm.errors import Forbidden
    from swarm.node.plan.authority import Strikes, check_epoch_end

    s = Strikes(window=300.0, every=3.0, limit=3)
    assert s.hear("A", 0.0) and not s.hear("A", 1.0) and s.hear("B", 1.0) and s.hear("A", 3.5)
    assert [s.strike("A", t) for t in (0.0, 1.0, 2.0)] == [1, 2, 3]
    assert s.strike("A", 400.0) == 1  # old strikes expire with the window
    s.forgive("A")
    assert s.strike("A", 401.0) == 1
    for i in range(1000):  # bounded whatever members send
        s.strike(f"P{i}", float(i))
        s.hear(f"P{i}", float(i))
    assert len(s._strikes) <= 257 and len(s._heard) <= 257
    check_epoch_end({"A", "B"}, "A", 5)
    with pytest.raises(Forbidden, match="only a member of that ring"):
        check_epoch_end({"A", "B"}, "C", 5)


def test_a_claimed_draft_speed_no_longer_outbids_the_measured_one_for_the_coordinator() -> None:
    """Issue 27: a member advertising a 0.01 ms/token draft took the coordinator (the role that
    sees every prompt). The leader now believes no one drafts faster than it measured its own
    draft; running none, no one faster than the upper median of the claims."""
    from swarm.node.plan.authority import bounded_draft_claims
    from swarm.planner import GB, ModelSpec, Peer, plan

    spec = ModelSpec(n_layers=32, layer_bytes=GB // 2, coordinator_bytes=GB)
    ids = ["c", "d", "e", "s1", "s2", "s3"]
    rtt = {a: {b: 0.2 for b in ids if b != a} for a in ids}
    stages = [Peer(s, 9 * GB, 0.01, coordinator_ok=False) for s in ("s1", "s2", "s3")]
    peers = [Peer("c", 3 * GB, 0.01), Peer("d", 3 * GB, 0.01, draft_ms=0.01, draft_bytes=GB),
             Peer("e", 3 * GB, 0.01, draft_ms=20.0, draft_bytes=GB), *stages]  # fmt: skip
    assert plan(spec, peers, rtt).coordinator == "d"  # the claim alone moved it
    bounded = bounded_draft_claims(peers, "c")
    assert [p.draft_ms for p in bounded[:3]] == [None, 20.0, 20.0]
    assert plan(spec, bounded, rtt).coordinator != "d"
    measured = [Peer("c", 3 * GB, 0.01, draft_ms=5.0, draft_bytes=GB), *peers[1:]]  # ours, measured: 5 ms
    assert [p.draft_ms for p in bounded_draft_claims(measured, "c")[:3]] == [5.0, 5.0, 20.0]
    alone = [Peer("c", 3 * GB, 0.01), peers[1]]  # a lone claim and nothing to compare it with: kept
    assert bounded_draft_claims(alone, "c")[1].draft_ms == 0.01


async def test_a_replan_that_moves_our_block_lets_go_of_the_old_one_before_loading() -> None:
    """The ended epoch holds no reference to its block while the next epoch's block loads (issue
    26: a re-plan never needs the old and the new block in memory together)."""
    import gc
    import weakref

    from swarm.manifest.identity import Identity
    from swarm.node.notices import Hooks, Notices
    from swarm.node.plan.epochs import Epochs, plan_body
    from swarm.node.ring.capacity import SlotQueue
    from swarm.node.settings import NodeSettings
    from swarm.proto.messages import Plan as PlanMsg
    from swarm.proto.signed import sign_plan

    class Block:  # stands for a loaded Stage: only its lifetime matters here
        def __init__(self, a: int, b: int) -> None:
            self.start, self.end = a, b

    class Models:  # Models.stage's contract: one block cached, cleared before the next loads
        def __init__(self) -> None:
            self.held: dict[tuple[int, int], Block] = {}
            self.alive_at_load: list[list[tuple[int, int]]] = []
            self.made: list[weakref.ref[Block]] = []

        async def stage(self, a: int, b: int, *, coordinator: bool = False) -> Block:
            if (a, b) in self.held:
                return self.held[(a, b)]
            self.held.clear()
            gc.collect()
            self.alive_at_load.append([(blk.start, blk.end) for r in self.made if (blk := r()) is not None])
            block = Block(a, b)
            self.made.append(weakref.ref(block))
            self.held[(a, b)] = block
            return block

    leader = Identity.generate()
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    models = Models()
    epochs = Epochs(settings, "A", models, SlotQueue(), Notices(Hooks()), leader=lambda: leader.peer_id,  # type: ignore[arg-type]
                    memory=dict)  # fmt: skip

    def signed(epoch: int, ring: tuple[str, ...]) -> PlanMsg:
        p = _plan(coord="C", ring=ring)
        p = Plan(epoch, p.n_layers, p.coordinator, p.ring, p.blocks, p.standbys, 1.0, 1.0)
        return sign_plan(PlanMsg(epoch, plan_body(p, "test")), leader, "friends")

    await epochs.accept("L", signed(3, ("A", "B", "D")))  # A holds [0, 3)
    await epochs.accept("L", signed(4, ("A", "B", "D")))  # the same block: kept, nothing loads
    await epochs.accept("L", signed(5, ("B", "A", "D")))  # A now holds [3, 6)
    assert models.alive_at_load == [[], []]  # [0, 3) was gone when [3, 6) loaded
    assert epochs.previous is not None and epochs.previous.stage is None
    assert epochs.current is not None and (epochs.current.stage.start, epochs.current.stage.end) == (3, 6)


def test_claims_of_memory_and_layer_speed_are_bounded_where_they_pick_the_coordinator() -> None:
    """Issue 27: memory and ms per layer are signed claims nobody else measures, and through the
    planner's predicted speed an absurd one (0.001 ms per layer, 10 TB) drew the coordinator to
    its claimant. They are now held to the leader's own figures (its measured ms per layer, the
    memory it offers) or, without them, to the conservative medians of the claims, for the
    choice of coordinator only; claims no better than that are left as they are."""
    from swarm.node.plan.authority import bounded_coordinator, bounded_role_claims, role_bounds
    from swarm.planner import GB, Latency, ModelSpec, Peer, plan

    spec = ModelSpec(n_layers=32, layer_bytes=GB // 4, coordinator_bytes=GB)
    ids = ["a", "b", "c", "z"]
    lat = Latency({x: {y: 0.5 for y in ids if y != x} for x in ids})
    honest = [Peer("a", 4 * GB, 2.0), Peer("b", 4 * GB, 2.0), Peer("c", 4 * GB, 2.1)]
    rogue = Peer("z", 10_000 * GB, 0.001)
    assert plan(spec, [*honest, rogue], lat).coordinator == "z"  # the claim alone took it
    assert role_bounds([*honest, rogue], "a") == (2.0, 4 * GB)  # ours: measured, offered
    bounded = bounded_role_claims([*honest, rogue], "a")
    assert bounded[:3] == honest  # no better than our figures: unchanged
    assert (bounded[3].ms_per_layer, bounded[3].memory_bytes) == (2.0, 4 * GB)
    coord = bounded_coordinator(spec, [*honest, rogue], lat, "a", previous=None, epoch=1)
    assert coord != "z"
    pinned = [dataclasses.replace(p, coordinator_ok=p.id == coord) for p in [*honest, rogue]]
    assert plan(spec, pinned, lat).blocks == {"z": (0, 32)}  # the layers still go where the claims say
    # the claims as made are what an honest swarm is planned by: the same coordinator as before
    assert bounded_coordinator(spec, honest, lat, "a", previous=None, epoch=1) == plan(spec, honest, lat).coordinator

    # without figures of our own (we offer no memory, measured nothing), the medians bound them:
    # the upper median of ms per layer, the lower median of memory
    us = Peer("a", 0, 0.0)
    assert role_bounds([us, *honest[1:], rogue], "a") == (2.0, 4 * GB)  # of 0.001, 2.0, 2.1 ms; 4, 4, 10^4 GB
    assert role_bounds([us, honest[1], rogue], "a") == (2.0, 4 * GB)  # of two: the honest one's

    # a claim is believed as far as the model needs it: 32 layers need a 9 GB claim believed
    # (the others offer 4 GB), so the cap rises to the smallest claim that holds the model, not 10 TB
    big = Peer("g", 9 * GB, 0.5)
    lat2 = Latency({x: {y: 0.5 for y in "agz" if y != x} for x in "agz"})
    small = [Peer("a", 3 * GB, 2.0), big]
    assert bounded_coordinator(spec, small, lat2, "a", previous=None, epoch=1) == plan(spec, small, lat2).coordinator
    assert bounded_coordinator(spec, [*small, Peer("z", 10_000 * GB, 0.001)], lat2, "a", previous=None, epoch=1) != "z"
    with pytest.raises(PlanningError, match="not enough memory"):
        bounded_coordinator(spec, [Peer("a", GB, 2.0)], lat2, "a", previous=None, epoch=1)
    # an RTT not measured yet is no reason to believe more: a rogue that claims to hold it all
    # alone needs no edge; the leader waits for the RTTs instead (PlanningError: "cannot plan yet")
    with pytest.raises(PlanningError, match="cannot reach each other"):
        bounded_coordinator(spec, [*honest, rogue], Latency({}), "a", previous=None, epoch=1)


def test_an_honest_mixed_swarm_keeps_its_layers_where_the_speed_is() -> None:
    """The bound picks the coordinator only: a 4090 next to the leader's laptop (claims ten
    times apart) still holds the layers its speed earns; the coordinator may sit one hop away."""
    from swarm.node.plan.authority import bounded_coordinator
    from swarm.planner import GB, Latency, ModelSpec, Peer, plan

    spec = ModelSpec(n_layers=32, layer_bytes=GB // 4, coordinator_bytes=GB)
    lat = Latency({"a": {"g": 0.5}, "g": {"a": 0.5}})
    peers = [Peer("a", 8 * GB, 10.0), Peer("g", 24 * GB, 1.0)]
    coord = bounded_coordinator(spec, peers, lat, "a", previous=None, epoch=1)
    pinned = [Peer(p.id, p.memory_bytes, p.ms_per_layer, coordinator_ok=p.id == coord) for p in peers]
    got = plan(spec, pinned, lat)
    assert got.blocks == {"g": (0, 32)}  # every layer on the fast machine
    assert got.predicted_compute_ms == plan(spec, peers, lat).predicted_compute_ms


def test_a_broken_hop_at_set_up_counts_only_on_the_leader_s_own_evidence() -> None:
    """issue 27: a failed set-up is a strike only on what the leader saw itself: a member
    silent to its own request, a door it could not open either, a hop into itself. A reporter
    accusing its neighbour alone strikes nobody (the rogue is often the reporter's neighbour,
    and a rogue reporter must not frame an honest one)."""
    from swarm.node.plan.authority import doors_to_probe, downstreams_of, setup_blame

    plan = _plan("C", ("A", "B", "D"))  # hops: C->A, A->B, B->D, D->C; the leader is L (a standby)
    every = {"C": "linked", "A": "linked", "B": "linked", "D": "linked"}
    assert downstreams_of(plan, "C") == {"A"} and downstreams_of(plan, "D") == {"C"}
    assert downstreams_of(_plan("C", ("C", "A")), "C") == {"A"}  # its hop into itself is local
    # A says its hop to B failed: the leader probes B itself; B's door answers: nobody
    a_fails = {**every, "A": "failed"}
    assert doors_to_probe(plan, "L", a_fails) == {"B"}
    assert setup_blame(plan, "L", a_fails, {"B": True}) == {}
    assert setup_blame(plan, "L", a_fails, {}) == {}  # not probed: no evidence either
    # B's door does not answer the leader either: B
    assert set(setup_blame(plan, "L", a_fails, {"B": False})) == {"B"}
    # a member silent to the leader's own connect: it, whatever else failed
    assert set(setup_blame(plan, "L", {**every, "B": "silent"}, {})) == {"B"}
    assert set(setup_blame(plan, "L", {**every, "A": "failed", "B": "silent"}, {"B": True})) == {"B"}
    # the leader in the ring: a hop into it that failed is its sender's; its own failed hop out
    # counts against the far end only when that door does not answer its probe either
    led = _plan("C", ("A", "L", "D"))  # C->A, A->L, L->D, D->C
    assert set(setup_blame(led, "L", {"C": "linked", "A": "failed", "L": "linked", "D": "linked"}, {})) == {"A"}
    mine = {"C": "linked", "A": "linked", "L": "failed", "D": "linked"}
    assert doors_to_probe(led, "L", mine) == {"D"}
    assert setup_blame(led, "L", mine, {"D": True}) == {}
    assert set(setup_blame(led, "L", mine, {"D": False})) == {"D"}
    # the leader as coordinator: no result link after the tail said its hop was open: the tail
    coord = _plan("L", ("A", "B"))  # L->A, A->B, B->L
    ok = {"L": "linked", "A": "linked", "B": "linked"}
    assert set(setup_blame(coord, "L", ok, {}, serve="failed")) == {"B"}
    assert set(setup_blame(coord, "L", {**ok, "B": "failed"}, {})) == {"B"}  # its only hop enters the leader
    # another coordinator that says its result link never came: its word against the tail's: nobody;
    # one silent to the leader's serve: it
    assert setup_blame(plan, "L", every, {}, serve="failed") == {}
    assert set(setup_blame(plan, "L", every, {}, serve="silent")) == {"C"}
    # the leader never strikes itself
    assert setup_blame(coord, "L", {**ok, "L": "silent"}, {}) == {}


def test_a_slow_but_honest_member_s_set_up_within_the_bound_is_no_strike() -> None:
    """A loaded member that answers (linked, or that its hop failed) before CONNECT_REPLY_S is
    "linked"/"failed", never "silent": no strike, however late within the bound (the leader's
    gathering is tested through processes in tests/security/test_setup_failures.py)."""
    from swarm.node.plan.authority import CONNECT_REPLY_S, setup_blame
    from swarm.node.plan.wiring import LINK_TIMEOUT_S

    assert CONNECT_REPLY_S >= LINK_TIMEOUT_S + 10  # an honest member's connect gives up by LINK_TIMEOUT_S
    plan = _plan("C", ("A", "B", "D"))
    assert setup_blame(plan, "L", {"C": "linked", "A": "linked", "B": "linked", "D": "linked"}, {}) == {}
    # a slow honest B whose hop to D timed out says so: D's door answers the leader, nobody
    assert setup_blame(plan, "L", {"C": "linked", "A": "linked", "B": "failed", "D": "linked"}, {"D": True}) == {}


async def test_the_leader_counts_a_member_silent_only_past_the_reply_bound(autojump_clock: object) -> None:
    """The leader's own gathering (``RingClient.ask_each`` at CONNECT_REPLY_S) under a mock
    clock: a member that answers ``linked`` 1 s before CONNECT_REPLY_S is "linked"; one whose answer is a failure is "failed"
    (its own timeout, said in a Fail, is no silence); one that never answers is "silent"."""
    import trio

    from swarm.errors import PeerTimeout
    from swarm.node.dispatch import RingClient
    from swarm.node.plan.authority import CONNECT_REPLY_S
    from swarm.proto import control as ctl

    class Ring(RingClient):
        def __init__(self) -> None:
            pass

        async def call(self, peer: str, msg: object, timeout: float) -> object:
            if peer == "slow":
                await trio.sleep(CONNECT_REPLY_S - 1)
                return ctl.Linked()
            if peer == "says-timeout":
                return ctl.fail_of(PeerTimeout("hop 2 to X not open within 20 s"))
            await trio.sleep(timeout)  # nothing ever comes: the call's own bound
            raise PeerTimeout("no answer")

    answers, replies, errors = await Ring().ask_each(["slow", "says-timeout", "rogue"], ctl.Connect(7), ctl.Linked,
                                                     CONNECT_REPLY_S)  # fmt: skip
    assert answers == {"slow": "linked", "says-timeout": "failed", "rogue": "silent"}
    assert set(replies) == {"slow"} and len(errors) == 2


def test_one_member_s_bad_bytes_reports_count_once_however_many_it_sends() -> None:
    from swarm.node.plan.authority import ByteReports

    r = ByteReports(window=300.0, max_entries=8)
    assert r.hear("A", "Z", 0.0) and not r.hear("A", "Z", 10.0) and r.hear("B", "Z", 11.0)
    assert r.hear("A", "Z", 301.0)  # a new window
    for i in range(50):
        r.hear(f"acc{i}", "Z", 400.0 + i)
    assert len(r._heard) <= 8


async def test_the_leader_strikes_a_reported_member_and_benches_what_it_saw_itself() -> None:
    from types import SimpleNamespace

    from swarm.node.plan.recovery import Recovery
    from swarm.proto import control as ctl

    struck: list[str] = []
    benched: list[str] = []
    benches = SimpleNamespace(strike=lambda p, why: struck.append(p), bench=lambda p, why: benched.append(p))
    view = SimpleNamespace(peer_id="L", leader=lambda: "L")
    rec = Recovery(view, None, SimpleNamespace(benches=benches), None, None, None)  # type: ignore[arg-type]
    for accuser in ("A", "A", "A", "B"):  # A's three reports count once
        assert isinstance(await rec.on_bad_bytes(accuser, ctl.BadBytes("Z", "bytes")), ctl.Ack)
    assert struck == ["Z", "Z"] and not benched
    await rec.on_bad_bytes("A", ctl.BadBytes("L", "bytes"))  # the leader does not bench itself on a word
    await rec.on_bad_bytes("A", ctl.BadBytes("A", "bytes"))
    rec.bad_bytes_report("L", "Y", "seen here")  # the leader's own fetch: benched at once
    assert struck == ["Z", "Z"] and benched == ["Y"]
    view.leader = lambda: "M"
    with pytest.raises(ProtocolError, match="not the leader"):
        await rec.on_bad_bytes("A", ctl.BadBytes("Z"))


def test_the_leaders_planning_puts_held_layers_on_their_holder_and_respects_disks() -> None:
    """Issue 25: the coordinator chosen with claims bounded, then the pinned plan (leader.plan_for)
    both see what members hold and their disk budgets."""
    from swarm.node.plan.authority import bounded_coordinator
    from swarm.planner import GB, Latency, ModelSpec, Peer, plan

    spec = ModelSpec(n_layers=32, layer_bytes=GB // 4, coordinator_bytes=GB)
    lat = Latency({x: {y: 0.5 for y in "abc" if y != x} for x in "abc"})
    peers = [Peer("a", 5 * GB, 2.0), Peer("b", 5 * GB, 2.0),
             Peer("c", 5 * GB, 2.0, held=frozenset(range(16)), held_head=True)]  # fmt: skip
    coord = bounded_coordinator(spec, peers, lat, "a", previous=None, epoch=1)
    pinned = [dataclasses.replace(p, coordinator_ok=p.id == coord) for p in peers]
    p = plan(spec, pinned, lat)
    assert coord == "c" and p.blocks["c"][0] == 0 and p.blocks["c"][1] >= 10
    tight = [dataclasses.replace(q, disk_bytes=GB) if q.id == "a" else q for q in peers]  # 4 layers at most
    q = plan(spec, [dataclasses.replace(x, coordinator_ok=x.id == coord) for x in tight], lat)
    s, e = q.blocks.get("a", (0, 0))
    assert e - s <= 4 and sum(e - s for s, e in q.blocks.values()) == 32
