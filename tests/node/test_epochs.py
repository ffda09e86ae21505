"""Plan epochs at a peer (node/plan/epochs.py): which epoch answers for a message, ending one
(stale reports change nothing), what a re-plan records, a task bounded by its epoch, and the
signed plan's body both ways. The epochs are a standby's (no block, not the coordinator: nothing
to load), on a mock clock; replayed and foreign-signed plans are in test_authority.py."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import PeerLost, ProtocolError
from swarm.manifest.identity import Identity
from swarm.node.compute import memory
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.epochs import Epoch, Epochs, hops, plan_body, plan_from_body
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import sign_plan

LEADER = Identity.generate()


def _plan(epoch: int, coord: str = "C", ring: tuple[str, ...] = ("A", "B")) -> Plan:
    blocks = {p: (3 * i, 3 * i + 3) for i, p in enumerate(ring)}
    return Plan(epoch, 3 * len(ring), coord, ring, blocks, ("S",), 12.5, 7.25, layers_moved=2)


def _signed(epoch: int, cause: str = "test", **kw: Any) -> PlanMsg:
    return sign_plan(PlanMsg(epoch, plan_body(_plan(epoch, **kw), cause)), LEADER, "friends")


def _epochs(me: str = "S", models: Any = None, **hooks: Any) -> tuple[Epochs, list[dict[str, Any]]]:
    life: list[dict[str, Any]] = []
    settings = NodeSettings(seed=b"s" * 32, swarm_id="friends", secret=b"x" * 32, model_dir=None)
    notices = Notices(Hooks(on_life=life.append))
    epochs = Epochs(settings, me, models, SlotQueue(), notices, leader=lambda: LEADER.peer_id, memory=dict, **hooks)
    return epochs, life


def test_the_signed_body_gives_the_plan_back_and_hops_go_round_the_ring() -> None:
    plan = _plan(9, ring=("A", "B", "D"))
    body = plan_body(plan, "x" * 1000)
    assert len(body["cause"]) == 300 and "draft" not in body
    back = plan_from_body(9, body)
    assert (back.coordinator, back.ring, back.blocks, back.standbys) == (plan.coordinator, plan.ring, plan.blocks, plan.standbys)
    assert (back.predicted_latency_ms, back.predicted_compute_ms, back.layers_moved) == (12.5, 7.25, 2)
    assert hops(plan) == [("C", "A"), ("A", "B"), ("B", "D"), ("D", "C")]  # hop i enters ring[i]; the last, C


async def test_which_epoch_answers_for_a_message(autojump_clock: trio.testing.MockClock) -> None:
    epochs, _ = _epochs()
    with pytest.raises(ProtocolError, match="current: None"):
        epochs.get(1)
    await epochs.accept("L", _signed(3))
    await epochs.accept("L", _signed(4, ring=("A", "D")))
    assert epochs.get(4).plan.epoch == 4 and epochs.serving is epochs.current
    with pytest.raises(ProtocolError, match="epoch 3 is not current here"):
        epochs.get(3)
    # a stage of the ring that just ended may still report on it; its signer no longer speaks for it
    assert epochs.roles(4) == (LEADER.peer_id, {"C", "A", "D"})
    assert epochs.roles(3) == (None, {"C", "A", "B"})
    with pytest.raises(ProtocolError, match="epoch 2 is not current"):
        epochs.roles(2)
    epochs.end("lost D")
    assert epochs.serving is None and epochs.known(4) is epochs.current
    assert epochs.roles(4) == (None, {"C", "A", "D"})  # ended: nobody signs for it any more
    with pytest.raises(ProtocolError):
        epochs.get(4)


async def test_a_stale_report_never_ends_the_epoch_that_replaced_it(autojump_clock: trio.testing.MockClock) -> None:
    ended: list[int] = []
    epochs, life = _epochs(on_end=lambda ep: ended.append(ep.plan.epoch))
    old = await epochs.accept("L", _signed(3))
    new = await epochs.accept("L", _signed(4))
    assert ended == [3] and not old.live  # taking epoch 4 ended epoch 3
    epochs.end("a link of epoch 3 closed", only=old)
    assert new.live and ended == [3]
    epochs.end("lost B", only=new)
    epochs.end("lost B again")  # an ended epoch ends once
    assert ended == [3, 4] and epochs.end_reason == "lost B"
    assert [e["event"] for e in life] == ["plan", "replan", "plan", "replan"]
    assert life[-1] == {"event": "replan", "ended_epoch": 4, "cause": "lost B"}


async def test_a_replan_records_what_replaced_the_ended_epoch_and_after_how_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    planned: list[int] = []
    epochs, life = _epochs()
    await epochs.accept("L", _signed(3), taken=lambda: planned.append(1))
    await trio.sleep(1)
    epochs.end("peer B is lost")
    await trio.sleep(2.5)
    ep = await epochs.accept("L", _signed(4, cause="peer B is lost", ring=("A",)), taken=lambda: planned.append(1))
    assert ep.cause == "peer B is lost" and len(planned) == 2
    (rec,) = epochs.replans
    assert (rec["epoch"], rec["reason"], rec["next_epoch"], rec["pause_s"]) == (3, "peer B is lost", 4, 2.5)
    assert life[-1]["event"] == "plan" and life[-1]["pause_s"] == 2.5 and life[-1]["role"] == "standby"
    assert life[0]["pause_s"] is None  # the first plan followed no ended epoch


async def test_a_plan_is_taken_only_when_signed_complete_and_newer(autojump_clock: trio.testing.MockClock) -> None:
    epochs, _ = _epochs()
    await epochs.accept("L", _signed(5))
    unsigned = PlanMsg(6, plan_body(_plan(6), "x"))
    with pytest.raises(ProtocolError, match="plan epoch 6 from L is unsigned"):
        await epochs.accept("L", unsigned)
    with pytest.raises(ProtocolError, match="not newer than the serving epoch 5"):
        await epochs.accept("L", _signed(5, cause="another body"))
    body = plan_body(_plan(7), "x")
    del body["ring"]
    with pytest.raises(ProtocolError, match="missing field 'ring'"):
        await epochs.accept("L", sign_plan(PlanMsg(7, body), LEADER, "friends"))
    assert epochs.current is not None and epochs.current.plan.epoch == 5 and epochs.current.live


async def test_an_epochs_task_ends_with_it_and_its_own_error_comes_out_unwrapped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ep = Epoch(_plan(1), b"")
    steps: list[str] = []

    async def forever() -> None:
        steps.append("start")
        await trio.sleep_forever()

    async def end_later() -> None:
        await trio.sleep(3)
        ep.done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(end_later)
        await ep.until_done(forever)
    assert steps == ["start"] and trio.current_time() == 3

    async def quick() -> None:
        steps.append("quick")

    await Epoch(_plan(2), b"").until_done(quick)  # returns with fn, the epoch still live
    assert steps[-1] == "quick"

    async def lost() -> None:
        raise PeerLost("hop 1 closed")

    with pytest.raises(PeerLost, match="hop 1 closed"):
        await Epoch(_plan(3), b"").until_done(lost)


def test_an_epochs_members_are_its_coordinator_and_ring_and_inbound_waits_are_shared() -> None:
    ep = Epoch(_plan(1, coord="C", ring=("A", "C")), b"")
    assert ep.members == {"A", "C"} and ep.live
    assert ep.wait_inbound(1) is ep.wait_inbound(1) and ep.wait_inbound(0) is not ep.wait_inbound(1)


async def test_wait_for_wakes_the_instant_an_epoch_is_taken_serves_or_ends(autojump_clock: trio.testing.MockClock) -> None:
    """Epochs.wait_for is woken by the change itself (no poll): each waiter returns at the virtual
    instant of the accept, mark_serving or end it waits on, and None at its timeout."""
    epochs, _ = _epochs()
    got: dict[str, tuple[float, Any]] = {}

    async def wait(name: str, ready: Any, timeout: float = 60) -> None:
        value = await epochs.wait_for(ready, timeout)
        got[name] = (trio.current_time(), value)

    def taken(n: int) -> Any:
        return lambda: epochs.current if epochs.current is not None and epochs.current.plan.epoch >= n else None

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "none", taken(9), 2.0)
        nursery.start_soon(wait, "taken", taken(3))
        nursery.start_soon(wait, "serving", lambda: epochs.current if epochs.current and epochs.current.serving.is_set() else None)
        nursery.start_soon(wait, "ended", lambda: epochs.current if epochs.current and not epochs.current.live else None)
        await trio.sleep(3.25)
        await epochs.accept("L", _signed(3))
        await trio.sleep(1.5)
        epochs.mark_serving(epochs.get(3))
        await trio.sleep(0.75)
        epochs.end("test")
    assert got["none"] == (2.0, None)
    assert got["taken"][0] == 3.25 and got["taken"][1].plan.epoch == 3
    assert got["serving"][0] == 4.75 and got["ended"][0] == 5.5


async def test_a_block_that_does_not_fit_lowers_the_offer_through_the_injected_hook(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Models.stage raises CannotLoad; the epochs ask the composition root's ``cannot_load`` for
    the lowered offer (with the role: a coordinator keeps its part) and say it in the error."""

    class _Models:
        async def stage(self, a: int, b: int) -> None:
            raise memory.CannotLoad(f"cannot load layers [{a}, {b}): out of memory")

    asked: list[tuple[int, int, bool]] = []

    def cannot_load(a: int, b: int, coordinator: bool) -> int:
        asked.append((a, b, coordinator))
        return 300_000_000

    epochs, _ = _epochs("A", models=_Models(), cannot_load=cannot_load)
    with pytest.raises(memory.CannotLoad, match=r"cannot load layers \[0, 3\).*now offers 0.30 GB"):
        await epochs.accept("L", _signed(3))
    assert asked == [(0, 3, False)]
