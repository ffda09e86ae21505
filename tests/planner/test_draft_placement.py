"""Where the coordinator goes when some peers hold a draft model: budgeted memory, ms per token."""

from __future__ import annotations

from swarm.planner import GB, ModelSpec, Peer, dump_peers_file, parse_peers_file, plan

SPEC = ModelSpec(n_layers=32, layer_bytes=GB // 2, coordinator_bytes=GB)
STAGES = ["s1", "s2", "s3"]


def rtts(to_c: float, to_d: float, between: float) -> dict[str, dict[str, float]]:
    ids = ["c", "d", *STAGES]
    out: dict[str, dict[str, float]] = {a: {} for a in ids}
    for a in ids:
        for b in ids:
            if a != b:
                out[a][b] = to_c if "c" in (a, b) else to_d if "d" in (a, b) else between
    return out


def peers(ms_per_layer: float, d_memory: int = 3 * GB, draft_ms: float = 20.0) -> list[Peer]:
    stages = [Peer(s, 9 * GB, ms_per_layer, coordinator_ok=False) for s in STAGES]
    return [Peer("c", 2 * GB, ms_per_layer), Peer("d", d_memory, ms_per_layer, draft_ms=draft_ms, draft_bytes=GB), *stages]


def test_a_slow_ring_puts_the_coordinator_where_the_draft_is() -> None:
    p = plan(SPEC, peers(1.0), rtts(to_c=20.0, to_d=30.0, between=20.0))
    assert p.coordinator == "d" and p.draft
    # the centroid (c) has the shorter traversal: the draft is what moved the coordinator
    assert p.note is not None and "holds a draft model" in p.note and "without a draft at c" in p.note


def test_a_fast_lan_keeps_the_centroid_when_the_draft_costs_more_than_a_traversal() -> None:
    p = plan(SPEC, peers(0.1), rtts(to_c=0.2, to_d=0.4, between=0.2))
    assert p.coordinator == "c" and not p.draft


def test_a_draft_holder_that_is_the_centroid_drafts() -> None:
    p = plan(SPEC, peers(1.0), rtts(to_c=30.0, to_d=20.0, between=20.0))
    assert p.coordinator == "d" and p.draft


def test_the_drafts_memory_is_budgeted_and_a_coordinator_without_room_goes_without() -> None:
    only_d = [p for p in peers(1.0, d_memory=int(1.5 * GB)) if p.id != "c"]  # 1 GB head + 1 GB draft > 1.5
    p = plan(SPEC, only_d, rtts(to_c=20.0, to_d=30.0, between=20.0))
    assert p.coordinator == "d" and not p.draft
    assert p.note is not None and "no coordinator has memory for its draft model" in p.note
    roomy = [p for p in peers(1.0, d_memory=2 * GB) if p.id != "c"]
    q = plan(SPEC, roomy, rtts(to_c=20.0, to_d=30.0, between=20.0))
    assert q.coordinator == "d" and q.draft and "d" not in q.blocks  # head + draft fill its 2 GB


def test_the_peers_file_carries_drafts() -> None:
    ps = peers(1.0)
    back = parse_peers_file(dump_peers_file(ps, rtts(20.0, 30.0, 20.0)))
    d = next(p for p in back.peers if p.id == "d")
    assert (d.draft_ms, d.draft_bytes) == (20.0, GB)
    assert next(p for p in back.peers if p.id == "c").draft_ms is None


def test_an_rtt_not_measured_yet_is_waited_for_not_planned_around_without_the_draft() -> None:
    """The draft's ring needs an edge nobody has measured yet: that is an error the node retries
    (with the RTT a moment later), not a reason to coordinate without the draft."""
    import pytest

    from swarm.errors import PlanningError

    # d (room for 6 layers without its draft, none with it) and three stages of 12 layers
    only_d = [Peer("d", 5 * GB, 1.0, draft_ms=20.0, draft_bytes=3 * GB)]
    only_d += [Peer(s, 6 * GB, 1.0, coordinator_ok=False) for s in STAGES]
    rtt = rtts(to_c=20.0, to_d=30.0, between=20.0)
    del rtt["s1"]["s2"], rtt["s2"]["s1"], rtt["s1"]["s3"], rtt["s3"]["s1"]  # s1 reaches only d so far
    with pytest.raises(PlanningError, match="cannot reach each other"):
        plan(SPEC, only_d, rtt)  # without the draft, d holding 6 layers would need only s2 and s3
    assert plan(SPEC, only_d, rtts(to_c=20.0, to_d=30.0, between=20.0)).draft  # once measured
