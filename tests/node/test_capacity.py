"""Capacity: sessions per KV memory at the context length, and the queue in front of the ring."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from swarm.errors import PlanningError
from swarm.node.ring.capacity import MAX_SESSIONS, Busy, SlotQueue, ring_capacity, stage_capacity
from swarm.planner import ModelSpec, Plan

SPEC = ModelSpec(n_layers=4, layer_bytes=1000, kv_bytes_per_token_per_layer=2, coordinator_bytes=500, context_tokens=100)


def test_stage_and_ring_capacity_follow_kv_memory_at_the_context_length() -> None:
    # 2 layers: weights 2000, one session's KV 2 * 2 * 100 = 400
    assert stage_capacity(SPEC, 2000 + 400 * 3 + 399, (0, 2), coordinator=False) == 3
    assert stage_capacity(SPEC, 2000 + 500 + 400 * 3, (0, 2), coordinator=True) == 3
    assert stage_capacity(SPEC, 2000, (0, 2), coordinator=False) == 1  # the planner reserved one
    assert stage_capacity(SPEC, 10**12, (0, 2), coordinator=False) == MAX_SESSIONS
    plan = Plan(epoch=1, n_layers=4, coordinator="a", ring=("a", "b"), blocks={"a": (0, 2), "b": (2, 4)},
                standbys=(), predicted_latency_ms=1.0, predicted_compute_ms=1.0)
    assert ring_capacity(SPEC, plan, {"a": 2000 + 500 + 400 * 5, "b": 2000 + 400 * 2}) == 2


def test_a_head_only_coordinator_bounds_the_ring_by_its_sessions_results_and_logits() -> None:
    """It holds no layers, but each session's results wait for its head and its logits come out
    of it (ModelSpec.head_session_bytes): the ring admits no more than its memory holds of those."""
    spec = ModelSpec(n_layers=4, layer_bytes=1000, kv_bytes_per_token_per_layer=2, coordinator_bytes=500,
                     context_tokens=100, inflight_bytes=10, head_logit_values=15)  # fmt: skip
    per = spec.head_session_bytes()
    assert per == 10 + 15 * 6
    plan = Plan(epoch=1, n_layers=4, coordinator="h", ring=("a", "b"), blocks={"a": (0, 2), "b": (2, 4)},
                standbys=(), predicted_latency_ms=1.0, predicted_compute_ms=1.0)
    stages = {p: 10**9 for p in "ab"}
    assert stage_capacity(spec, 500 + 3 * per, (0, 0), coordinator=True) == 3
    assert ring_capacity(spec, plan, stages | {"h": 500 + 3 * per + per - 1}) == 3
    assert ring_capacity(spec, plan, stages | {"h": 500 + 5 * per}) == 5
    assert ring_capacity(SPEC, plan, stages | {"h": 500}) == MAX_SESSIONS  # no vocabulary, no window: nothing to hold


async def test_admission_queues_in_order_with_a_notice_and_refuses_past_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = SlotQueue(2, max_queued=2)
    order: list[str] = []
    notices: list[str] = []

    async def gen(name: str, seconds: float) -> None:
        await adm.enter(notices.append)
        order.append(name)
        try:
            await trio.sleep(seconds)
        finally:
            adm.leave()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gen, "a", 5.0)
        nursery.start_soon(gen, "b", 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(gen, "c", 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(gen, "d", 1.0)
        await trio.sleep(0.1)
        assert sorted(order) == ["a", "b"] and adm.active == 2
        with pytest.raises(Busy, match="retry in") as info:
            await adm.enter()
        assert info.value.retry_after_s > 0
    assert order[2:] == ["c", "d"] and adm.active == 0  # the queue is FIFO
    assert len(notices) == 2 and notices[0].startswith("queued: the ring holds 2")


async def test_a_waiter_that_goes_away_gives_its_place_up(autojump_clock: trio.testing.MockClock) -> None:
    adm = SlotQueue(1)
    await adm.enter()
    with trio.move_on_after(1.0):
        await adm.enter()  # the client hung up while queued
    adm.leave()
    with trio.fail_after(0.1):
        await adm.enter()
    assert adm.active == 1


def test_the_api_answers_busy_with_429_and_retry_after() -> None:
    from swarm.api.requests import ApiError
    from swarm.api.server import error_response

    err = ApiError("the swarm is busy", status=429, type="server_error", code="swarm_busy")
    err.retry_after_s = 5
    resp = error_response(err)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "5"
    assert "retry-after" not in error_response(ApiError("bad", status=400)).headers


def test_capacity_is_the_budget_solved_for_sessions_with_the_activations_and_the_reserve() -> None:
    """The stage's capacity and the planner's feasibility are one sum (planner/budget.py): a peer
    advertising exactly the predicted peak of its block with the 8 sessions it reserves holds 8,
    one byte less holds 7 (the activations count once, a head-only coordinator runs none)."""
    from swarm.planner.budget import predicted_peak

    spec = ModelSpec(n_layers=4, layer_bytes=1000, kv_bytes_per_token_per_layer=2, coordinator_bytes=500,
                     context_tokens=100, sessions=8, activation_bytes=333)  # fmt: skip
    for coord in (False, True):
        exact = predicted_peak(spec, (0, 2), coordinator=coord)
        assert exact == 2 * 1000 + 2 * 8 * 200 + 333 + (500 if coord else 0)
        assert stage_capacity(spec, exact, (0, 2), coordinator=coord) == 8
        assert stage_capacity(spec, exact - 1, (0, 2), coordinator=coord) == 7
    assert stage_capacity(spec, 500, (0, 0), coordinator=True) == MAX_SESSIONS  # no layers: no KV to hold
    plan = Plan(epoch=1, n_layers=4, coordinator="a", ring=("a", "b"), blocks={"a": (0, 2), "b": (2, 4)},
                standbys=(), predicted_latency_ms=1.0, predicted_compute_ms=1.0)
    exact = predicted_peak(spec, (0, 2), coordinator=True, draft_bytes=400)  # the coordinator's draft model too
    memory = {"a": exact, "b": 10**9}
    assert ring_capacity(spec, plan, memory, {"a": 400}) == 8 and ring_capacity(spec, plan, memory) == 9


async def test_a_new_plans_capacity_lets_waiters_in_in_order_and_a_smaller_one_keeps_their_places(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A re-plan changes the ring's capacity (epochs.py): more slots let the first waiters in, in
    queue order; fewer slots after waiters were woken send them back to wait in their places."""
    adm = SlotQueue(1)
    await adm.enter()  # one generation runs
    admitted: list[str] = []

    async def waiter(name: str) -> None:
        await adm.enter()
        admitted.append(name)

    async with trio.open_nursery() as nursery:
        for name in "abcd":
            nursery.start_soon(waiter, name)
            await trio.sleep(0.1)
        assert adm.queued == 4 and admitted == []
        adm.set_capacity(3)  # two more slots: the first two waiters, no one else
        await trio.sleep(0.1)
        assert sorted(admitted) == ["a", "b"] and adm.active == 3 and adm.queued == 2  # woken together
        adm.set_capacity(2)  # fewer slots than run: nobody new gets in, even when one leaves
        adm.leave()
        await trio.sleep(0.1)
        assert len(admitted) == 2 and adm.active == 2
        adm.leave()  # one below capacity now: the head of the queue, c, and only c
        await trio.sleep(0.1)
        assert admitted[2:] == ["c"] and adm.queued == 1
        adm.set_capacity(0)  # a capacity is at least one
        assert adm.capacity == 1
        for _ in range(adm.active):
            adm.leave()
    assert admitted[2:] == ["c", "d"] and adm.active == 1


def test_a_nodes_sessions_reserve_is_its_specs_and_what_its_plans_reserve(tmp_path: Path) -> None:
    """``join --sessions N`` (node.sessions) reaches the one budget arithmetic: the node's spec
    reserves N sessions' KV in every layer it plans, its predicted peak counts N, and fewer
    sessions let the same memory hold the whole model where eight do not."""
    import torch

    from swarm.node.compute.runtime import Compute, Models
    from swarm.node.notices import Hooks, Notices
    from swarm.node.settings import NodeSettings, peak_bytes
    from swarm.planner import Latency, Peer, plan
    from swarm.planner.budget import predicted_peak
    from swarm.testing.checkpoints import TinySpec, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4), seed=0)
    settings = [NodeSettings(seed=b"s" * 32, swarm_id="s", secret=b"x" * 32, model_dir=ckpt, sessions=n, context_tokens=64)
                for n in (2, 8)]  # fmt: skip
    few, many = (Models(s, Compute(threads=False), Notices(Hooks())).spec for s in settings)
    assert (few.sessions, many.sessions) == (2, 8)
    whole = (0, 4)
    assert predicted_peak(many, whole, coordinator=True) - predicted_peak(few, whole, coordinator=True) == \
        6 * (4 * few.session_kv_bytes_per_layer + few.inflight_bytes + few.head_session_bytes())  # fmt: skip
    args = Models(settings[0], Compute(threads=False), Notices(Hooks())).args
    # a session's hidden states on their way: its whole context (64 tokens, under the prefill window), 2-byte unit
    assert few.inflight_bytes == 64 * args.dim * 2
    assert peak_bytes(args, torch.float32, "cpu", few, whole, coordinator=True) < \
        peak_bytes(args, torch.float32, "cpu", many, whole, coordinator=True)  # fmt: skip
    memory = predicted_peak(few, whole, coordinator=True)  # one peer, the whole model with two sessions
    assert plan(few, [Peer("a", memory, 1.0)], Latency({})).blocks == {"a": whole}
    with pytest.raises(PlanningError, match="not enough memory"):
        plan(many, [Peer("a", memory, 1.0)], Latency({}))
