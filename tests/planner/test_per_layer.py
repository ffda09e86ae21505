"""Layers of different sizes (DeepSeek-V3 / GLM-4.5: dense first layers, MoE after): each block is
budgeted at its own layers' sizes, blocks stay contiguous, and the result is never worse than
budgeting every layer at the largest one's size."""

from __future__ import annotations

import random

import pytest

from swarm.errors import PlanningError, UsageError
from swarm.planner import GB, Latency, ModelSpec, Peer, plan
from swarm.planner.alloc import Ctx, allocate_exact

# 2 dense layers of 1 GB, then 8 MoE layers of 4 GB
EACH = (GB, GB) + (4 * GB,) * 8
SPEC = ModelSpec(n_layers=10, layer_bytes=4 * GB, coordinator_bytes=GB, layer_bytes_each=EACH)
AS_LARGEST = ModelSpec(n_layers=10, layer_bytes=4 * GB, coordinator_bytes=GB)


def mesh(ids: list[str], ms: float = 5.0) -> dict[str, dict[str, float]]:
    return {a: {b: ms for b in ids if b != a} for a in ids}


def _fits(spec: ModelSpec, p, peers: list[Peer]) -> None:  # type: ignore[no-untyped-def]
    mem = {q.id: q.memory_bytes for q in peers}
    at = 0
    for pid in p.ring:  # contiguous in ring order, from layer 0
        s, e = p.blocks[pid]
        assert s == at and e > s
        at = e
        extra = spec.coordinator_bytes if pid == p.coordinator else 0
        assert spec.block_bytes(s, e) + extra <= mem[pid], (pid, s, e)
    assert at == spec.n_layers


def test_dense_first_layers_are_budgeted_at_their_own_size() -> None:
    peers = [Peer(x, 12 * GB, 1.0) for x in ("a", "b", "c")]
    with pytest.raises(PlanningError, match="not enough memory"):
        plan(AS_LARGEST, peers, mesh(["a", "b", "c"]))  # 10 x 4 GB + 1 GB > 36 GB
    p = plan(SPEC, peers, mesh(["a", "b", "c"]))  # 2 x 1 + 8 x 4 + 1 = 35 GB <= 36 GB
    _fits(SPEC, p, peers)
    assert p.blocks[p.coordinator] == (0, 4)  # coordinator part + both dense layers + 2 MoE layers
    assert sorted(e - s for s, e in p.blocks.values()) == [3, 3, 4]


def test_exact_allocation_follows_the_ring_order() -> None:
    spec = ModelSpec(n_layers=4, layer_bytes=4, layer_bytes_each=(1, 1, 4, 4))
    peers = [Peer("a", 6, 1.0), Peer("b", 6, 1.0)]
    ctx = Ctx.build(spec, peers, Latency({}))
    assert allocate_exact(ctx, [0, 1], 0) == (4.0, [3, 1])  # a: 1+1+4, b: 4
    assert allocate_exact(ctx, [1, 0], 1) == (4.0, [3, 1])
    assert allocate_exact(Ctx.build(spec, [Peer("a", 5, 1.0), Peer("b", 5, 1.0)], Latency({})), [0, 1], 0) is None


def test_never_worse_than_budgeting_the_largest_layer() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        n_layers = rng.randint(4, 16)
        dense = rng.randint(0, 3)
        each = tuple(rng.choice([1, 2]) if i < dense else rng.choice([5, 6]) for i in range(n_layers))
        kv = rng.choice([0, 1])
        spec = ModelSpec(n_layers, max(each), kv_bytes_per_token_per_layer=kv, context_tokens=2,
                         coordinator_bytes=rng.choice([0, 3]), layer_bytes_each=each)  # fmt: skip
        largest = ModelSpec(n_layers, max(each), kv_bytes_per_token_per_layer=kv, context_tokens=2,
                            coordinator_bytes=spec.coordinator_bytes)  # fmt: skip
        ids = [f"p{i}" for i in range(rng.randint(1, 5))]
        peers = [Peer(x, rng.randint(8, 40), rng.choice([1.0, 2.0, 3.0])) for x in ids]
        rtt = {a: {b: float(rng.randint(1, 20)) for b in ids if b != a} for a in ids}
        try:
            old = plan(largest, peers, rtt)
        except PlanningError:
            old = None
        try:
            new = plan(spec, peers, rtt)
        except PlanningError:
            assert old is None, "budgeting each layer's own size lost a placement"
            continue
        _fits(spec, new, peers)
        if old is not None:
            checked += 1
            assert new.predicted_traversal_ms <= old.predicted_traversal_ms + 1e-9
    assert checked > 10


def test_equal_sizes_change_nothing_and_bad_sizes_are_refused() -> None:
    peers = [Peer(x, 12 * GB, 1.0) for x in ("a", "b", "c")]
    same = ModelSpec(n_layers=6, layer_bytes=GB, coordinator_bytes=GB, layer_bytes_each=(GB,) * 6)
    assert same.uniform
    assert plan(same, peers, mesh(["a", "b", "c"])) == plan(ModelSpec(6, GB, coordinator_bytes=GB), peers,
                                                            mesh(["a", "b", "c"]))  # fmt: skip
    with pytest.raises(UsageError, match="layer_bytes_each must give 3 sizes"):
        ModelSpec(n_layers=3, layer_bytes=2, layer_bytes_each=(1, 2))
    with pytest.raises(UsageError, match="whose largest is layer_bytes"):
        ModelSpec(n_layers=2, layer_bytes=3, layer_bytes_each=(1, 2))
    assert SPEC.total_bytes == 35 * GB and SPEC.block_bytes(0, 3) == 6 * GB


def test_a_sticky_replan_keeps_blocks_that_fit_at_their_own_size() -> None:
    ids = ["a", "b", "c", "d"]
    peers = [Peer(x, 12 * GB, 1.0) for x in ids]
    first = plan(SPEC, peers, mesh(ids))
    _fits(SPEC, first, peers)
    gone = first.ring[-1]
    left = [q for q in peers if q.id != gone]
    again = plan(SPEC, left, mesh([q.id for q in left]), previous=first)
    _fits(SPEC, again, left)
    kept = [q for q in first.ring if q != gone and again.blocks.get(q) == first.blocks[q]]
    assert kept, (first, again)  # survivors kept their blocks
