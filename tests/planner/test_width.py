"""A peer's own width (issue 26): a quantized layer's packed integers do not widen with the
serving dtype, so an fp32 peer's int4 layer is stated in the planner's 2-byte unit at what it
really holds (ModelSpec.at_width), not at twice its bf16 bytes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import UsageError
from swarm.node.ring.capacity import ring_capacity, stage_capacity
from swarm.planner import ModelSpec, Peer, Plan, dump_peers_file, parse_peers_file, plan
from swarm.planner.budget import predicted_peak

from .swarms import plan_or_error, swarms

# an int4-like layer in the planner's unit: 1000 bytes, of which 800 are packed integers (the same
# at any width) and 200 scales and norms (2 bytes a value); one session's KV: 10 * 10 bytes
SPEC = ModelSpec(n_layers=12, layer_bytes=1000, kv_bytes_per_token_per_layer=10, coordinator_bytes=500,
                 context_tokens=10, sessions=2, activation_bytes=50, compact_bytes_each=(800,) * 12)  # fmt: skip


def mesh(ids: list[str], ms: float = 5.0) -> dict[str, dict[str, float]]:
    return {a: {b: ms for b in ids if b != a} for a in ids}


def real_bytes(spec: ModelSpec, width: int, i: int) -> int:
    """What layer ``i`` holds in real bytes at ``width``: its integers, and its rest widened."""
    c = spec.compact_bytes_each[i] if spec.compact_bytes_each else 0
    return c + (spec.weights[i] - c) * width // 2


def test_at_width_states_the_compact_part_at_what_it_really_holds() -> None:
    assert SPEC.at_width(2) is SPEC
    wide = SPEC.at_width(4)  # an fp32 peer: 800 real bytes of integers + 400 of scales = 1200 real = 600 here
    assert wide.weights == (600,) * 12 and wide.layer_bytes == 600 and wide.compact_bytes_each == (400,) * 12
    assert wide.weights[0] * 4 // 2 == real_bytes(SPEC, 4, 0) == 1200
    assert (wide.kv_bytes_per_token_per_layer, wide.activation_bytes, wide.coordinator_bytes) == (10, 50, 500)
    narrow = SPEC.at_width(1)  # an fp8 peer: 800 + 100 real = 1800 here
    assert narrow.weights[0] == 1800 and narrow.weights[0] * 1 // 2 == real_bytes(SPEC, 1, 0)
    dense = dataclasses.replace(SPEC, compact_bytes_each=())
    assert dense.at_width(4) == dataclasses.replace(dense, width=4)  # every byte widens: the 2-byte unit is exact
    odd = dataclasses.replace(SPEC, compact_bytes_each=(801,) * 12)
    assert odd.at_width(4).weights[0] * 2 >= real_bytes(odd, 4, 0)  # rounded up, never below what it holds
    with pytest.raises(UsageError, match="dtype_bytes"):
        SPEC.at_width(0)


def test_a_spec_refuses_compact_parts_it_cannot_hold() -> None:
    with pytest.raises(UsageError, match="compact_bytes_each"):
        dataclasses.replace(SPEC, compact_bytes_each=(800,) * 11)
    with pytest.raises(UsageError, match="compact_bytes_each"):
        dataclasses.replace(SPEC, compact_bytes_each=(1001,) * 12)  # more than the layer itself
    with pytest.raises(UsageError, match="compact_bytes_each"):
        dataclasses.replace(SPEC, compact_bytes_each=(-1,) * 12)
    with pytest.raises(UsageError, match="dtype_bytes"):
        Peer("a", 1, 1.0, dtype_bytes=3)


def test_an_fp32_peer_that_says_its_width_takes_the_layers_its_memory_really_holds() -> None:
    ids = ["lead", "wide"]
    memory = 500 + 6 * (1000 + 2 * 100) + 50  # the head and six layers, each counted at its bf16 size
    lead = Peer("lead", memory, 1.0)
    before = plan(SPEC, [lead, Peer("wide", memory, 0.5)], mesh(ids))
    wide = Peer("wide", memory, 0.5, dtype_bytes=4)
    after = plan(SPEC, [lead, wide], mesh(ids))
    held = {p: e - s for p, (s, e) in after.blocks.items()}
    assert held["wide"] > before.blocks["wide"][1] - before.blocks["wide"][0]
    s, e = after.blocks["wide"]
    own = predicted_peak(wide.own(SPEC), (s, e), coordinator=after.coordinator == "wide")
    assert own <= memory < predicted_peak(SPEC, (s, e), coordinator=after.coordinator == "wide")
    # in real bytes: the layers at fp32 and the KV and activations at 4 bytes fit what it offered at 4 bytes
    real = sum(real_bytes(SPEC, 4, i) for i in range(s, e)) + (e - s) * 2 * 100 * 2 + 50 * 2
    assert real <= memory * 4 // 2


def test_capacity_states_each_stage_at_its_own_width() -> None:
    ids = ["lead", "wide"]
    memory = 500 + 6 * (1000 + 2 * 100) + 50
    wide = Peer("wide", memory, 0.5, dtype_bytes=4)
    p = plan(SPEC, [Peer("lead", memory, 1.0), wide], mesh(ids))
    block = p.blocks["wide"]
    mine = stage_capacity(wide.own(SPEC), memory, block, coordinator=p.coordinator == "wide")
    assert mine >= 2  # the leader planned its two sessions
    assert stage_capacity(SPEC, memory, block, coordinator=p.coordinator == "wide") < 2  # at bf16 they would not fit
    caps = {q: stage_capacity(SPEC, memory, p.blocks[q], coordinator=q == p.coordinator) for q in ids if q != "wide"}
    assert ring_capacity(SPEC, p, {q: memory for q in ids}, widths={"wide": 4}) == min([mine, *caps.values()])


def test_the_peers_file_carries_a_peers_width() -> None:
    peer = Peer("amy", 8000, 1.0, dtype_bytes=4)
    pf = dump_peers_file([peer, Peer("bob", 9000, 1.0)], {})
    assert pf["peers"][0]["dtype_bytes"] == 4 and "dtype_bytes" not in pf["peers"][1]
    assert parse_peers_file(pf).peers == (peer, Peer("bob", 9000, 1.0))
    for bad in (0, 3, 2.0, "4", True):
        with pytest.raises(UsageError, match="dtype_bytes"):
            parse_peers_file({"peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1, "dtype_bytes": bad}]})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swarms(compact=True), st.data())
def test_a_2_byte_width_plans_as_before_and_every_block_fits_its_real_bytes(swarm, data) -> None:  # type: ignore[no-untyped-def]
    spec, peers, rtt = swarm
    old = plan_or_error(spec, peers, rtt)
    assert plan_or_error(spec, [dataclasses.replace(q, dtype_bytes=2) for q in peers], rtt) == old
    mixed = [dataclasses.replace(q, dtype_bytes=data.draw(st.sampled_from([None, 2, 4]))) for q in peers]
    p = plan_or_error(spec, mixed, rtt)
    if isinstance(p, Plan):
        for q in mixed:
            if q.id not in p.blocks and q.id != p.coordinator:
                continue
            w = q.dtype_bytes or 2
            s, e = p.blocks.get(q.id, (0, 0))
            coord = q.id == p.coordinator
            real = (sum(real_bytes(spec, w, i) for i in range(s, e))
                    + ((e - s) * spec.kv_bytes_per_layer + (spec.transient_bytes if e > s else 0)
                       + (spec.coordinator_bytes if coord else 0)) * w // 2)  # fmt: skip
            assert real <= q.memory_bytes * w // 2, (q, p)  # what it holds, inside what it offered at its width
