"""Held layers and disk budgets (issue 25): speed first, then fewer bytes moved; never a block a
peer's disk cannot take."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import PlanningError, UsageError
from swarm.planner import GB, ModelSpec, Peer, Plan, plan
from swarm.planner.search import MOVE_TOLERANCE
from tests.planner.test_properties import instances

SPEC = ModelSpec(n_layers=20, layer_bytes=GB, coordinator_bytes=GB)


def mesh(ids: list[str], ms: float = 5.0) -> dict[str, dict[str, float]]:
    return {a: {b: ms for b in ids if b != a} for a in ids}


def moved(spec: ModelSpec, peers: list[Peer], p: Plan) -> int:
    by = {q.id: q for q in peers}
    total = by[p.coordinator].moved_bytes(spec, 0, 0, coordinator=True)
    for pid, (s, e) in p.blocks.items():
        total += by[pid].moved_bytes(spec, s, e)
    return total


def test_a_holder_gets_its_layers_when_speeds_tie() -> None:
    bare = [Peer("amy", 11 * GB, 1.0), Peer("bob", 11 * GB, 1.0)]
    before = plan(SPEC, bare, mesh(["amy", "bob"]))
    assert before.coordinator == "amy" and before.blocks == {"amy": (0, 10), "bob": (10, 20)}  # by ID
    for head in (True, False):
        peers = [bare[0], dataclasses.replace(bare[1], held=frozenset(range(10)), held_head=head)]
        p = plan(SPEC, peers, mesh(["amy", "bob"]))
        assert p.blocks["bob"] == (0, 10) and p.coordinator == "bob"
        assert p.predicted_traversal_ms == pytest.approx(before.predicted_traversal_ms)
        assert moved(SPEC, peers, p) == 10 * GB + (0 if head else GB)


def test_a_holder_of_the_middle_and_a_whole_copy_are_found() -> None:
    ids = ["amy", "bob", "cat"]
    peers = [Peer(x, 8 * GB, 1.0) for x in ids]
    peers[2] = dataclasses.replace(peers[2], held=frozenset(range(7, 14)))
    p = plan(SPEC, peers, mesh(ids))
    assert p.blocks["cat"][0] <= 7 and p.blocks["cat"][1] >= 13
    # three machines that each hold the whole model: the one that holds it already is the one used
    big = [Peer(x, 40 * GB, 1.0) for x in ids]
    big[2] = dataclasses.replace(big[2], held=frozenset(range(20)), held_head=True)
    q = plan(SPEC, big, mesh(ids))
    assert q.ring == ("cat",) and q.coordinator == "cat" and moved(SPEC, big, q) == 0


def test_a_disk_that_cannot_take_a_block_never_gets_it() -> None:
    fast = Peer("fast", 40 * GB, 0.5, disk_bytes=5 * GB)
    slow = Peer("slow", 40 * GB, 2.0)
    p = plan(SPEC, [fast, slow], mesh(["fast", "slow"]))
    assert plan(SPEC, [dataclasses.replace(fast, disk_bytes=None), slow], mesh(["fast", "slow"])).ring == ("fast",)
    s, e = p.blocks.get("fast", (0, 0))
    assert fast.stores(SPEC, s, e, coordinator=p.coordinator == "fast") and e - s >= 4
    assert sum(e - s for s, e in p.blocks.values()) == 20
    # what it holds does not count against its disk
    held = dataclasses.replace(fast, held=frozenset(range(20)), held_head=True, disk_bytes=0)
    assert plan(SPEC, [held, slow], mesh(["fast", "slow"])).ring == ("fast",)


def test_no_disk_can_take_the_model_is_a_clear_error() -> None:
    peers = [Peer("amy", 40 * GB, 1.0, disk_bytes=3 * GB), Peer("bob", 40 * GB, 1.0, disk_bytes=3 * GB)]
    with pytest.raises(PlanningError, match="not enough disk.*amy 3.00 GB.*raise --disk"):
        plan(SPEC, peers, mesh(["amy", "bob"]))
    # layers of different sizes: the same rule, through the exact counts
    spec = dataclasses.replace(SPEC, layer_bytes_each=(GB // 2,) + (GB,) * 19)
    with pytest.raises(PlanningError, match="not enough disk"):
        plan(spec, peers, mesh(["amy", "bob"]))
    ok = [dataclasses.replace(q, disk_bytes=12 * GB) for q in peers]
    p = plan(spec, ok, mesh(["amy", "bob"]))
    assert all(q.stores(spec, *p.blocks[q.id], coordinator=q.id == p.coordinator) for q in ok if q.id in p.blocks)


def test_a_much_faster_plan_beats_one_that_moves_nothing() -> None:
    holder = Peer("holder", 40 * GB, 10.0, held=frozenset(range(20)), held_head=True)
    fast = Peer("fast", 40 * GB, 1.0)
    p = plan(SPEC, [holder, fast], mesh(["holder", "fast"]))
    assert p.ring == ("fast",) and p.coordinator == "fast"
    # within the tolerance the holder wins
    close = dataclasses.replace(holder, ms_per_layer=1.0 * (1 + MOVE_TOLERANCE / 2))
    assert plan(SPEC, [close, fast], mesh(["holder", "fast"])).ring == ("holder",)


def test_peers_without_the_fields_plan_as_before() -> None:
    ids = ["a", "b", "c", "d"]
    peers = [Peer(x, (6 + i) * GB, 1.0 + i / 4) for i, x in enumerate(ids)]
    p = plan(SPEC, peers, mesh(ids))
    unbounded = [dataclasses.replace(q, held=frozenset(), held_head=False, disk_bytes=None) for q in peers]
    assert plan(SPEC, unbounded, mesh(ids)) == p


def test_the_peers_file_carries_held_layers_and_disk() -> None:
    from swarm.planner import dump_peers_file, parse_peers_file

    peer = Peer("amy", 8 * GB, 1.0, held=frozenset({0, 1, 2, 9}), held_head=True, disk_bytes=2 * GB)
    pf = dump_peers_file([peer, Peer("bob", GB, 1.0)], {})
    assert pf["peers"][0]["held"] == {"0": 3, "9": 10} and "held" not in pf["peers"][1]
    assert parse_peers_file(pf).peers == (peer, Peer("bob", GB, 1.0))
    for bad in ({"3": 3}, {"x": 2}, [0, 1], {"0": True}):
        with pytest.raises(UsageError, match="held"):
            parse_peers_file({"peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1, "held": bad}]})
    with pytest.raises(UsageError, match="disk_gb"):
        parse_peers_file({"peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1, "disk_gb": -1}]})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_peers=6), st.data())
def test_held_layers_never_cost_more_than_the_tolerance_and_disks_are_respected(
    inst: tuple[ModelSpec, list[Peer], dict], data: st.DataObject
) -> None:
    spec, peers, rtt = inst
    try:
        bare = plan(spec, peers, rtt)
    except PlanningError:
        return
    held = []
    for q in peers:
        lo = data.draw(st.integers(0, spec.n_layers))
        hi = data.draw(st.integers(lo, spec.n_layers))
        disk = data.draw(st.one_of(st.none(), st.integers(0, spec.total_bytes)))
        held.append(dataclasses.replace(q, held=frozenset(range(lo, hi)), held_head=data.draw(st.booleans()), disk_bytes=disk))
    unbounded = [dataclasses.replace(q, disk_bytes=None) for q in held]
    p = plan(spec, unbounded, rtt)  # what is held never makes a plan impossible, only slower within the tolerance
    assert p.predicted_traversal_ms <= bare.predicted_traversal_ms * (1 + MOVE_TOLERANCE) + 1e-6
    assert moved(spec, unbounded, p) <= moved(spec, unbounded, bare)
    try:
        d = plan(spec, held, rtt)
    except PlanningError as exc:
        assert "disk" in str(exc)
        return
    by = {q.id: q for q in held}
    assert by[d.coordinator].stores(spec, *d.blocks.get(d.coordinator, (0, 0)), coordinator=True)
    assert all(by[x].stores(spec, s, e, coordinator=x == d.coordinator) for x, (s, e) in d.blocks.items())
