"""Property tests: determinism, valid blocks, memory respected, and exact optimality up to 8 peers.

The optimum is computed here independently of the planner: every coordinator, every vector of
layer counts, and every ordering of the nodes, by plain enumeration.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import PlanningError
from swarm.planner import Latency, ModelSpec, Peer, plan

BPL = 10  # bytes per layer in these instances


@st.composite
def instances(draw: st.DrawFn, max_peers: int = 8) -> tuple[ModelSpec, list[Peer], dict]:
    n = draw(st.integers(1, max_peers))
    n_layers = draw(st.integers(1, 7))
    coord_bytes = draw(st.sampled_from([0, 5, 15]))
    spec = ModelSpec(n_layers=n_layers, layer_bytes=BPL, coordinator_bytes=coord_bytes)
    peers = []
    for i in range(n):
        mem = draw(st.integers(0, n_layers * BPL + coord_bytes))
        speed = draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0, 7.25]))
        ok = draw(st.booleans()) if i else True
        peers.append(Peer(f"peer-{i}", mem, speed, ok))
    rtt: dict[str, dict[str, float]] = {}
    for a, b in itertools.permutations([p.id for p in peers], 2):
        if draw(st.integers(0, 9)) == 0:
            continue  # missing entry
        rtt.setdefault(a, {})[b] = float(draw(st.integers(1, 60)))
    return spec, peers, rtt


def _cycle_costs(ids: list[str], lat: Latency) -> dict[frozenset[str], float]:
    """Shortest directed cycle through every non-empty subset, by trying every permutation."""
    out: dict[frozenset[str], float] = {}
    for k in range(1, len(ids) + 1):
        for combo in itertools.combinations(ids, k):
            first, rest = combo[0], combo[1:]
            best = math.inf
            for perm in itertools.permutations(rest):
                path = (first, *perm, first)
                best = min(best, sum(lat.hop(a, b) for a, b in zip(path, path[1:], strict=False)))
            out[frozenset(combo)] = best if k > 1 else 0.0
    return out


def _counts(caps: list[int], total: int, at: int = 0):
    if at == len(caps):
        if total == 0:
            yield ()
        return
    for c in range(min(caps[at], total) + 1):
        for rest in _counts(caps, total - c, at + 1):
            yield (c, *rest)


def brute_force(spec: ModelSpec, peers: list[Peer], rtt: dict) -> float:
    lat = Latency(rtt)
    ids = [p.id for p in peers]
    cycles = _cycle_costs(ids, lat)
    best = math.inf
    for c, coord in enumerate(peers):
        if not coord.coordinator_ok or coord.memory_bytes < spec.coordinator_bytes:
            continue
        caps = [
            (p.memory_bytes - (spec.coordinator_bytes if k == c else 0)) // BPL
            for k, p in enumerate(peers)
        ]
        for counts in _counts(caps, spec.n_layers):
            nodes = frozenset([coord.id] + [ids[k] for k, n in enumerate(counts) if n])
            compute = sum(n * p.ms_per_layer for n, p in zip(counts, peers, strict=True))
            best = min(best, cycles[nodes] + compute)
    return best


def check_valid(spec: ModelSpec, peers: list[Peer], rtt: dict, p) -> None:
    by_id = {q.id: q for q in peers}
    at = 0
    for sid in p.ring:
        s, e = p.blocks[sid]
        assert s == at and e > s, (sid, s, e, at)
        at = e
    assert at == spec.n_layers
    assert len(set(p.ring)) == len(p.ring)
    for sid, (s, e) in p.blocks.items():
        need = (e - s) * spec.bytes_per_layer + (
            spec.coordinator_bytes if sid == p.coordinator else 0
        )
        assert need <= by_id[sid].memory_bytes
    coord = by_id[p.coordinator]
    assert coord.coordinator_ok and coord.memory_bytes >= spec.coordinator_bytes
    assert all(math.isfinite(h) for h in p.hops_ms)
    assert set(p.standbys) == set(by_id) - set(p.ring) - {p.coordinator}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_plan_is_optimal_valid_and_deterministic(inst) -> None:
    spec, peers, rtt = inst
    opt = brute_force(spec, peers, rtt)
    if math.isinf(opt):
        with pytest.raises(PlanningError):
            plan(spec, peers, rtt)
        return
    p = plan(spec, peers, rtt)
    check_valid(spec, peers, rtt, p)
    assert p.predicted_traversal_ms == pytest.approx(opt, abs=1e-9)
    # same plan whatever order the peers and the RTT rows arrive in
    shuffled = list(peers)
    random.Random(len(peers)).shuffle(shuffled)
    rtt2 = {a: dict(reversed(list(row.items()))) for a, row in reversed(list(rtt.items()))}
    q = plan(spec, shuffled, rtt2)
    assert q.to_json() == p.to_json()
    assert list(q.blocks.items()) == list(p.blocks.items())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(11, 40), st.integers(0, 10**6))
def test_heuristic_plans_are_valid_and_deterministic(n: int, seed: int) -> None:
    rng = random.Random(seed)
    spec = ModelSpec(n_layers=24, layer_bytes=BPL, coordinator_bytes=15)
    peers = [
        Peer(
            f"h{i:02d}", rng.randint(20, 120), rng.choice([0.5, 1.0, 2.0, 3.5]), rng.random() < 0.7
        )
        for i in range(n)
    ]
    peers[0] = Peer("h00", 400, 1.0, True)  # always feasible
    pts = [(rng.random(), rng.random()) for _ in range(n)]
    rtt = {
        a.id: {
            b.id: 1 + 100 * math.dist(pts[i], pts[j]) * rng.uniform(1.0, 1.3)
            for j, b in enumerate(peers)
            if i != j and rng.random() > 0.1
        }
        for i, a in enumerate(peers)
    }
    p = plan(spec, peers, rtt)
    check_valid(spec, peers, rtt, p)
    assert plan(spec, list(reversed(peers)), rtt).to_json() == p.to_json()
