"""One memory budget per peer (planner/budget.py): the planned part's arithmetic, the overhead,
and the planner's feasibility agreeing with it exactly."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.errors import PlanningError
from swarm.planner import Latency, ModelSpec, Peer, plan
from swarm.planner.budget import (
    COORDINATOR_RUNTIME_BYTES,
    RUNTIME_BYTES,
    TOKENIZER_IN_RUNTIME,
    predicted_peak,
    runtime_overhead,
    sessions_that_fit,
)

# 4 layers of 1000 bytes; one session's KV is 2 * 100 = 200 bytes a layer; 3 sessions reserved,
# each with 11 bytes of hidden states on their way at a stage
SPEC = ModelSpec(n_layers=4, layer_bytes=1000, kv_bytes_per_token_per_layer=2, coordinator_bytes=500,
                 context_tokens=100, sessions=3, activation_bytes=70, inflight_bytes=11)  # fmt: skip


def test_the_planned_part_counts_weights_reserved_kv_activations_and_the_coordinator_part() -> None:
    assert SPEC.session_kv_bytes_per_layer == 200 and SPEC.kv_bytes_per_layer == 600
    assert SPEC.transient_bytes == 70 + 3 * 11  # a forward's activations, each session's window on its way
    assert predicted_peak(SPEC, (0, 2), coordinator=False) == 2 * 1000 + 2 * 600 + 70 + 3 * 11
    # the coordinator also holds each session's results on their way to its head (the same window)
    assert predicted_peak(SPEC, (0, 2), coordinator=True, draft_bytes=9) == 2 * 1000 + 2 * 600 + 70 + 33 + 500 + 33 + 9
    assert predicted_peak(SPEC, (0, 2), coordinator=False, sessions=5) == 2 * 1000 + 2 * 5 * 200 + 70 + 5 * 11
    # a head-only coordinator runs no stage: no KV, no activations; only what its sessions send its head
    assert predicted_peak(SPEC, (0, 0), coordinator=True) == 500 + 3 * 11
    # at load: no session's KV and no prefill chunk yet, the weights and the coordinator part already
    assert predicted_peak(SPEC, (0, 2), coordinator=False, at_load=True) == 2 * 1000
    assert predicted_peak(SPEC, (0, 2), coordinator=True, draft_bytes=9, sessions=5, at_load=True) == 2 * 1000 + 500 + 9


def test_sessions_that_fit_is_predicted_peak_solved_for_sessions() -> None:
    for memory in range(2000, 4000, 37):
        n = sessions_that_fit(SPEC, memory, (1, 3), coordinator=True)
        assert n is not None
        assert predicted_peak(SPEC, (1, 3), coordinator=True, sessions=n) <= memory
        assert predicted_peak(SPEC, (1, 3), coordinator=True, sessions=n + 1) > memory
    assert sessions_that_fit(SPEC, 10**6, (0, 0), coordinator=False) is None  # no layers, no head: sessions cost nothing
    for memory in range(500, 2000, 37):  # a head-only coordinator: each session's results and logits
        n = sessions_that_fit(HEAD, memory, (0, 0), coordinator=True)
        assert n is not None
        assert predicted_peak(HEAD, (0, 0), coordinator=True, sessions=n) <= memory
        assert predicted_peak(HEAD, (0, 0), coordinator=True, sessions=n + 1) > memory


# SPEC with a vocabulary: each session's chunk asks the head for 5 logits
HEAD = dataclasses.replace(SPEC, head_logit_values=5)


def test_a_head_only_coordinator_counts_each_sessions_results_and_logits() -> None:
    """The tail sends every piece's hidden states to the coordinator, layers or none: each session
    holds its window of them there and one chunk's float32 logits (in bf16 beside the head's bf16
    output until it is upcast: 6 bytes a value), in the planner's unit at the peer's width."""
    per = 11 + 5 * (4 + 2)
    assert HEAD.head_session_bytes() == per and HEAD.coordinator_at(3) == 500 + 3 * per
    assert predicted_peak(HEAD, (0, 0), coordinator=True) == 500 + 3 * per
    assert predicted_peak(HEAD, (0, 0), coordinator=True, sessions=8, draft_bytes=9) == 500 + 8 * per + 9
    assert predicted_peak(HEAD, (0, 0), coordinator=True, at_load=True) == 500  # no session yet
    assert predicted_peak(HEAD, (0, 2), coordinator=True) == predicted_peak(SPEC, (0, 2), coordinator=True) + 3 * 5 * 6
    # an fp32 peer: its logits are the head's own output (no copy), 20 real bytes = 10 in the unit
    assert HEAD.at_width(4).head_session_bytes() == 11 + 10
    assert HEAD.at_width(1).head_session_bytes() == 11 + 5 * (4 + 1) * 2  # fp8: the output and its upcast
    # the planner counts it too (Peer.coordinator_part): a peer with room for the head alone is no coordinator
    need = predicted_peak(HEAD, (0, 0), coordinator=True)
    assert Peer("c", need, 1.0).layer_capacity(HEAD, coordinator=True) == 0
    assert Peer("c", need - 1, 1.0).layer_capacity(HEAD, coordinator=True) == -1
    lat = Latency({"c": {"s": 1.0}})
    stage = Peer("s", predicted_peak(HEAD, (0, 4), coordinator=False), 1.0, coordinator_ok=False)
    head_only = plan(HEAD, [Peer("c", need, 1.0), stage], lat)
    assert head_only.coordinator == "c" and head_only.blocks == {"s": (0, 4)}
    with pytest.raises(PlanningError, match="no peer can be coordinator"):
        plan(HEAD, [Peer("c", need - 1, 1.0), stage], lat)


def test_the_overhead_is_the_runtime_and_a_layer_on_cpu_and_nothing_on_cuda() -> None:
    """A coordinator's runtime is a stage's and its own (tokenizer, the head's load); what an
    advert leaves out is the coordinator's, since any peer may be chosen."""
    coord = RUNTIME_BYTES + COORDINATOR_RUNTIME_BYTES + 1234
    assert runtime_overhead("cpu", 1234) == runtime_overhead("cpu", 1234, coordinator=True) == coord
    assert runtime_overhead("mps", 1234) == coord
    assert runtime_overhead("cpu", 1234, coordinator=False) == RUNTIME_BYTES + 1234 < coord
    assert runtime_overhead("cuda", 1234) == runtime_overhead("cuda", 1234, coordinator=False) == 0


def test_a_tokenizer_larger_than_the_coordinators_allowance_adds_the_rest_to_a_coordinator_only() -> None:
    """Gemma 3's tokenizer holds ~290 MB where the coordinator's constant holds 40: a coordinator
    (and so every advert) counts the rest, a stage nothing; one within the allowance changes nothing."""
    coord = runtime_overhead("cpu", 1234)
    assert runtime_overhead("cpu", 1234, tokenizer_bytes=TOKENIZER_IN_RUNTIME) == coord
    assert runtime_overhead("cpu", 1234, tokenizer_bytes=335 * 10**6) == coord + 335 * 10**6 - TOKENIZER_IN_RUNTIME
    assert runtime_overhead("cpu", 1234, coordinator=False, tokenizer_bytes=335 * 10**6) == RUNTIME_BYTES + 1234
    assert runtime_overhead("cuda", 1234, tokenizer_bytes=335 * 10**6) == 0


def test_the_planner_places_a_block_exactly_when_its_predicted_peak_fits() -> None:
    """Two peers, two layers each; the coordinator holds its part too. One byte less than the
    predicted peak of either and the model no longer fits."""
    need_c = predicted_peak(SPEC, (0, 2), coordinator=True)
    need_s = predicted_peak(SPEC, (2, 4), coordinator=False)
    lat = Latency({"a": {"b": 1.0}})
    p = plan(SPEC, [Peer("a", need_c, 1.0), Peer("b", need_s, 1.0, coordinator_ok=False)], lat)
    assert p.coordinator == "a" and p.blocks == {"a": (0, 2), "b": (2, 4)}
    for short in ([need_c - 1, need_s], [need_c, need_s - 1]):
        with pytest.raises(PlanningError, match="not enough memory"):
            plan(SPEC, [Peer("a", short[0], 1.0), Peer("b", short[1], 1.0, coordinator_ok=False)], lat)


def test_layers_of_different_sizes_are_budgeted_the_same_way() -> None:
    spec = ModelSpec(n_layers=3, layer_bytes=3000, layer_bytes_each=(100, 100, 3000), kv_bytes_per_token_per_layer=1,
                     context_tokens=10, sessions=2, activation_bytes=50, inflight_bytes=7)  # fmt: skip
    need = [predicted_peak(spec, (0, 2), coordinator=True), predicted_peak(spec, (2, 3), coordinator=False)]
    lat = Latency({"a": {"b": 1.0}})
    p = plan(spec, [Peer("a", need[0], 1.0), Peer("b", need[1], 1.0, coordinator_ok=False)], lat)
    assert p.blocks == {"a": (0, 2), "b": (2, 3)}
    with pytest.raises(PlanningError):
        plan(spec, [Peer("a", need[0], 1.0), Peer("b", need[1] - 1, 1.0, coordinator_ok=False)], lat)
