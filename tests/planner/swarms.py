"""Random small swarms for the planner's property tests (hypothesis), and a plan or its refusal."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from swarm.errors import PlanningError
from swarm.planner import ModelSpec, Peer, Plan, plan

Swarm = tuple[ModelSpec, list[Peer], dict[str, dict[str, float]]]


@st.composite
def swarms(draw: st.DrawFn, *, per_layer_optional: bool = False, compact: bool = False) -> Swarm:
    """1-6 layers of 400-1000 bytes (listed per layer unless ``per_layer_optional`` draws one
    size for all), with ``compact``: sometimes a width-fixed part per layer; 1-5 peers, the first
    sure to serve, and every RTT between them."""
    n_layers = draw(st.integers(1, 6))
    each = tuple(draw(st.lists(st.sampled_from([400, 700, 1000]), min_size=n_layers, max_size=n_layers)))
    fixed = tuple(draw(st.integers(0, w)) for w in each) if compact and draw(st.booleans()) else ()
    listed = each if not per_layer_optional or draw(st.booleans()) else ()
    spec = ModelSpec(n_layers=n_layers, layer_bytes=max(each) if listed else 1000, layer_bytes_each=listed,
                     compact_bytes_each=fixed, kv_bytes_per_token_per_layer=draw(st.sampled_from([0, 5, 30])),
                     context_tokens=10, coordinator_bytes=draw(st.sampled_from([0, 300])),
                     sessions=draw(st.integers(1, 8)), activation_bytes=draw(st.sampled_from([0, 50])),
                     inflight_bytes=draw(st.sampled_from([0, 9])))  # fmt: skip
    peers = [Peer(f"p{i}", draw(st.integers(0, 3 * 1000 * n_layers)), draw(st.sampled_from([0.5, 1.0, 2.0])),
                  draw(st.booleans()) if i else True) for i in range(draw(st.integers(1, 5)))]  # fmt: skip
    rtt: dict[str, dict[str, float]] = {}
    for a, b in itertools.permutations([q.id for q in peers], 2):
        rtt.setdefault(a, {})[b] = float(draw(st.integers(1, 40)))
    return spec, peers, rtt


def plan_or_error(spec: ModelSpec, peers: list[Peer], rtt: dict[str, dict[str, float]]) -> Plan | str:
    try:
        return plan(spec, peers, rtt)
    except PlanningError as exc:
        return str(exc)
