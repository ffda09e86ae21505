"""Where a forward runs (model/batched.py, InlinePolicy): a quick call inline; one session's small call
inline while its typical (median) time is under LONE_INLINE_MAX_S, whatever one preempted call
took; a batch of several sessions by the rise-at-once prediction (the LM head and the stage worker
that hold one: tests/node/test_headbatch.py, test_stage_worker.py). Times are given, never
measured: nothing here depends on this machine's speed."""

from __future__ import annotations

from swarm.model.batched import INLINE_MAX_S, LONE_INLINE_MAX_S, LONE_SAMPLES, InlinePolicy


def _after(times: list[float], *, small: bool = True) -> InlinePolicy:
    p = InlinePolicy()
    for took in times:
        p.note(took, small=small)
    return p


def test_nothing_is_inline_before_a_call_was_timed() -> None:
    p = InlinePolicy()
    assert not p.inline(small=True, lone=True) and not p.inline(small=True, lone=False)


def test_a_quick_call_runs_inline_and_a_replay_group_counts_its_forwards() -> None:
    p = _after([0.001])
    assert p.inline(small=True, lone=False) and p.inline(small=False, lone=False)
    assert p.inline(calls=4, small=False, lone=False)  # 4 ms in all
    assert not p.inline(calls=6, small=False, lone=False)  # 6 ms in all: over INLINE_MAX_S


def test_a_lone_small_call_runs_inline_under_the_lone_bound_and_a_shared_one_does_not() -> None:
    p = _after([0.02, 0.02, 0.02])
    assert p.predict_s > INLINE_MAX_S
    assert p.inline(small=True, lone=True)
    assert not p.inline(small=True, lone=False), "several sessions: the loop is not held 20 ms"
    assert not p.inline(small=False, lone=True), "a long chunk (a prefill piece) is not lone's case"
    assert not p.inline(calls=2, small=False, lone=True), "a replay group is not lone's case"


def test_one_preempted_call_does_not_send_the_next_lone_ones_to_a_thread() -> None:
    p = _after([0.02, 0.02, 0.02, 0.3])  # the last one was preempted on a busy box
    assert p.predict_s == 0.3, "the rise-at-once prediction took it"
    assert p.inline(small=True, lone=True), "the median did not"
    assert not p.inline(small=True, lone=False)


def test_a_slow_model_moves_the_lone_calls_to_a_thread_within_a_few_calls() -> None:
    p = _after([0.02] * LONE_SAMPLES)
    slow = 2 * LONE_INLINE_MAX_S
    for _ in range(LONE_SAMPLES // 2):
        p.note(slow, small=True)
        assert p.inline(small=True, lone=True), "a minority of slow calls"
    p.note(slow, small=True)
    assert not p.inline(small=True, lone=True), "most of the last calls were slow"


def test_a_big_call_is_no_sample_of_the_small_ones() -> None:
    p = _after([0.02, 0.02, 0.02])
    p.note(1.0, small=False)  # a prefill piece
    p.note(1.0, calls=3, small=False)  # a replay group
    assert p.typical_s == 0.02 and p.inline(small=True, lone=True)
