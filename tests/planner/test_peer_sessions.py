"""Each peer's own session count (issue 26): its advert says how many sessions' KV its stage
reserves, and the leader plans its block with that count instead of its own."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import PlanningError, UsageError
from swarm.node.ring.capacity import ring_capacity, stage_capacity
from swarm.planner import ModelSpec, Peer, Plan, dump_peers_file, parse_peers_file, plan
from swarm.planner.budget import predicted_peak

from .swarms import plan_or_error, swarms

# a layer: 1000 bytes of weights; one session's KV in it: 10 * 10 = 100 bytes; the leader reserves 8
SPEC = ModelSpec(n_layers=12, layer_bytes=1000, kv_bytes_per_token_per_layer=10, coordinator_bytes=500,
                 context_tokens=10, sessions=8)  # fmt: skip
UNEVEN = dataclasses.replace(SPEC, layer_bytes_each=(600, 1000, 800, 1000, 700, 1000, 900, 1000, 600, 1000, 800, 1000))


def mesh(ids: list[str], ms: float = 5.0) -> dict[str, dict[str, float]]:
    return {a: {b: ms for b in ids if b != a} for a in ids}


def own_peak(spec: ModelSpec, peer: Peer, p: Plan) -> int:
    block = p.blocks.get(peer.id, (0, 0))
    return predicted_peak(spec, block, coordinator=peer.id == p.coordinator, draft_bytes=peer.draft_bytes,
                          sessions=peer.sessions)  # fmt: skip


@pytest.mark.parametrize("spec", [SPEC, UNEVEN], ids=["uniform", "per-layer"])
def test_a_member_with_fewer_sessions_is_planned_with_room_for_its_own(spec: ModelSpec) -> None:
    ids = ["lead", "two"]
    memory = 500 + 6 * (1000 + 8 * 100) + 100  # the leader's head and six layers at eight sessions
    lead = Peer("lead", memory, 1.0)
    before = plan(spec, [lead, Peer("two", memory, 0.5)], mesh(ids))  # the faster: as many layers as fit
    two = Peer("two", memory, 0.5, sessions=2)
    after = plan(spec, [lead, two], mesh(ids))
    held = {p: e - s for p, (s, e) in after.blocks.items()}
    was = {p: e - s for p, (s, e) in before.blocks.items()}
    assert held["two"] > was["two"] and held["lead"] < was["lead"]  # its KV is smaller: it takes more layers
    assert own_peak(spec, two, after) <= memory < predicted_peak(spec, after.blocks["two"], coordinator=False)
    assert own_peak(spec, lead, after) <= memory


def test_fewer_sessions_on_a_member_let_a_swarm_hold_what_eight_do_not() -> None:
    ids = ["lead", "two"]
    lead = Peer("lead", 500 + 5 * (1000 + 800), 1.0)  # its head and five layers at eight sessions
    tight = 7 * (1000 + 200)  # seven layers at two sessions, under four at eight
    with pytest.raises(PlanningError, match="not enough memory"):
        plan(SPEC, [lead, Peer("two", tight, 1.0)], mesh(ids))
    p = plan(SPEC, [lead, Peer("two", tight, 1.0, sessions=2)], mesh(ids))
    assert p.blocks["two"][1] - p.blocks["two"][0] == 7


def test_the_ring_holds_the_least_of_its_stages_sessions() -> None:
    """A member planned with two sessions' KV holds two: the ring's capacity, the least of its
    stages, falls to two, as the leader's admission must (capacity.ring_capacity)."""
    ids = ["lead", "two"]
    memory = 500 + 6 * (1000 + 8 * 100) + 100
    two = Peer("two", memory, 0.5, sessions=2)  # the faster: as many layers as its two sessions leave room for
    p = plan(SPEC, [Peer("lead", memory, 1.0), two], mesh(ids))
    caps = {q: stage_capacity(SPEC, memory, p.blocks[q], coordinator=q == p.coordinator) for q in ids}
    assert caps["lead"] >= 8 and 2 <= caps["two"] < 8
    assert ring_capacity(SPEC, p, {q: memory for q in ids}) == min(caps.values()) == caps["two"]


def test_the_peers_file_carries_a_peers_sessions() -> None:
    peer = Peer("amy", 8000, 1.0, sessions=3)
    pf = dump_peers_file([peer, Peer("bob", 9000, 1.0)], {})
    assert pf["peers"][0]["sessions"] == 3 and "sessions" not in pf["peers"][1]
    assert parse_peers_file(pf).peers == (peer, Peer("bob", 9000, 1.0))
    for bad in (0, -2, 1.5, "8", True):
        with pytest.raises(UsageError, match="sessions"):
            parse_peers_file({"peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1, "sessions": bad}]})
    with pytest.raises(UsageError, match="sessions"):
        Peer("a", 1, 1.0, sessions=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swarms(per_layer_optional=True), st.data())
def test_old_adverts_plan_as_before_and_every_block_fits_its_own_sessions(swarm, data) -> None:  # type: ignore[no-untyped-def]
    spec, peers, rtt = swarm
    old = plan_or_error(spec, peers, rtt)
    # an advert without the field plans exactly as one that says the planning peer's own count
    assert plan_or_error(spec, [dataclasses.replace(q, sessions=spec.sessions) for q in peers], rtt) == old
    mixed = [dataclasses.replace(q, sessions=data.draw(st.none() | st.integers(1, 12))) for q in peers]
    p = plan_or_error(spec, mixed, rtt)
    if isinstance(p, Plan):
        for q in mixed:
            if q.id in p.blocks or q.id == p.coordinator:
                assert own_peak(spec, q, p) <= q.memory_bytes, (q, p)


def test_plan_prints_each_peers_peak_with_its_own_sessions() -> None:
    from swarm.cli.plan import predicted_peaks

    ids = ["lead", "two"]
    memory = 500 + 6 * (1000 + 8 * 100) + 100
    peers = [Peer("lead", memory, 1.0), Peer("two", memory, 0.5, sessions=2)]
    p = plan(SPEC, peers, mesh(ids))
    peaks = predicted_peaks(p, SPEC, peers)
    assert peaks == {q.id: own_peak(SPEC, q, p) for q in peers}
    s, e = p.blocks["two"]
    assert peaks["two"] == predicted_peak(SPEC, (s, e), coordinator=False) - (e - s) * 6 * 100 <= memory
