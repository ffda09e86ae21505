"""A hypothesis fuzz of every ring control message through the role table (issue 27).

A real node (the composition root of ``join``, on the in-memory network: swarm/testing/memswarm.py)
leads a 3-node swarm that serves. Hypothesis draws sequences of (sender role, message) with
random epochs (the current one, its neighbours, far past the step bound) and random fields
(inside and past their bounds), and each is dispatched by the leader's ``/shard-swarm/ring/1``
table exactly as a stream from that sender would be. After each: no exception escaped (every
refusal is a ``fail`` reply), and the leader's state (its epoch and whether it is live, whom it
benched, who it believes is leaving) changed only in a way that sender's role may cause:

- outsider (not admitted), client (admitted, never advertised): nothing;
- a member out of the ring (a standby): only ``leaving``/``leave`` about itself, and being
  benched itself (strikes);
- a stage or the coordinator of the live epoch: also ending that epoch (``ended``, ``leave``)
  and, by a fault report about its own upstream, a bench of one or both ends of that hop;
- nobody but the leader itself makes a new epoch (a plan or ``connect``/``serve`` from anyone
  else is refused, signed by the sender or not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.manifest.identity import Identity
from swarm.proto import control as ctl
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import sign_plan
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import SWARM_ID, MemSwarm

pytestmark = pytest.mark.timeout(600)

ROLES_DRAWN = ("outsider", "client", "standby", "stage", "coordinator")
EPOCH_MAX = (1 << 62) - 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fuzz"), TinySpec(n_layers=8, row_gain_spread=1.0), seed=5)



epochs = st.one_of(st.sampled_from(["cur", "cur", "cur", "cur-1", "cur+1", "cur+10001"]), st.integers(0, EPOCH_MAX))
texts = st.text(max_size=40) | st.text(min_size=990, max_size=1000)
ops = st.one_of(
    st.tuples(st.just("plan"), epochs, st.booleans(), st.sampled_from(["self", "leader-ring", "junk"])),
    st.tuples(st.just("connect"), epochs),
    st.tuples(st.just("serve"), epochs),
    st.tuples(st.just("current")),
    st.tuples(st.just("ended"), epochs),
    st.tuples(st.just("leaving")),
    st.tuples(st.just("leave")),
    st.tuples(st.just("fault"), st.sampled_from(ROLES_DRAWN + ("leader", "nobody")), epochs, texts),
    st.tuples(st.just("status")),
)
steps = st.lists(st.tuples(st.sampled_from(ROLES_DRAWN), ops), min_size=4, max_size=12)


def _state(peer: Any) -> tuple[int | None, bool, frozenset[str], frozenset[str]]:
    ep = peer.epoch
    now = trio.current_time()
    benched = frozenset(p for p, t in peer.view.excluded.items() if t > now)
    return (None if ep is None else ep.plan.epoch, bool(ep is not None and ep.live), benched, frozenset(peer.view.leaving))


def _epoch(e: Any, cur: int) -> int:
    if isinstance(e, int):
        return e
    return {"cur": cur, "cur-1": max(0, cur - 1), "cur+1": cur + 1, "cur+10001": cur + 10_001}[e]


def _message(op: tuple[Any, ...], cur: int, sender: str, ident: Identity | None, ids: dict[str, str]) -> ctl.Control | PlanMsg:
    kind = op[0]
    if kind == "plan":
        _k, e, signed, body_kind = op
        body = {"junk": [1, 2]} if body_kind == "junk" else {
            "n_layers": 8, "coordinator": sender if body_kind == "self" else ids["coordinator"],
            "ring": [sender], "blocks": {sender: [0, 8]}, "standbys": []}  # fmt: skip
        msg = PlanMsg(_epoch(e, cur), body)
        return sign_plan(msg, ident, SWARM_ID) if signed and ident is not None else msg
    if kind in ("connect", "serve", "ended"):
        cls = {"connect": ctl.Connect, "serve": ctl.Serve, "ended": ctl.Ended}[kind]
        return cls(_epoch(op[1], cur))
    if kind == "fault":
        _k, who, e, reason = op
        return ctl.Fault(ids.get(who, "12D3KooWnobody"), _epoch(e, cur), reason)
    return {"current": ctl.Current, "leaving": ctl.Leaving, "leave": ctl.Leave, "status": ctl.Status}[kind]()


def _allowed(role: str, op: str, sender: str, before: tuple[Any, ...], after: tuple[Any, ...], ring: set[str]) -> str | None:
    """None when ``before`` -> ``after`` is a change ``role`` may cause with ``op``, else why not."""
    e0, live0, bench0, leaving0 = before
    e1, live1, bench1, leaving1 = after
    if (e1, live1, bench1, leaving1) == (e0, live0, bench0, leaving0):
        return None
    if role in ("outsider", "client"):
        return "an outsider or client changed the leader's state"
    if leaving1 - leaving0 - {sender}:
        return f"{sender} made others leave: {leaving1 - leaving0}"
    if e1 != e0 and e1 is not None and e0 is not None and e1 > e0 and op not in ("leave", "ended", "fault"):
        return f"a {op} from a {role} made epoch {e1}"
    if live0 and not live1 and not (sender in ring and op in ("ended", "leave", "fault")):
        return f"a {op} from a {role} ended the live epoch"
    new_bench = bench1 - bench0
    if new_bench - {sender} and not (op == "fault" and sender in ring):
        return f"a {op} from a {role} benched {new_bench - {sender}}"
    return None


async def _run(ckpt: Path, seq: list[tuple[str, tuple[Any, ...]]]) -> None:
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        plan = await swarm.ready()
        leader = swarm.peers[0]
        ring = {plan.coordinator, *plan.ring}
        standby = next(p for p in swarm.ids if p not in ring)
        stage = next((p for p in plan.ring if p not in (plan.coordinator, swarm.ids[0])), None) or plan.ring[-1]
        ids = {"standby": standby, "stage": stage, "coordinator": plan.coordinator, "leader": swarm.ids[0]}
        seeds = dict(zip(swarm.ids, swarm.seeds, strict=True))
        async with swarm.client(0) as (_h, _p):
            ids["client"] = _h.peer_id
            ids["outsider"] = Identity(os.urandom(32)).peer_id
            table = leader.serving.ring.local
            for role, op in seq:
                sender = ids[role]
                if sender == ids["leader"]:
                    continue  # the leader's own requests are dispatched as its own
                ep = leader.epoch
                cur = ep.plan.epoch if ep is not None else 0
                ident = Identity(seeds[sender]) if sender in seeds else None
                msg = _message(op, cur, sender, ident, ids)
                before = _state(leader)
                with trio.move_on_after(30):
                    reply = await table(sender, msg)
                    assert isinstance(reply, ctl.Control | PlanMsg), reply
                after = _state(leader)
                live_ring = {ep.plan.coordinator, *ep.plan.ring} if ep is not None else set()
                why = _allowed(role, op[0], sender, before, after, live_ring)
                assert why is None, f"{why} ({role} {sender[:12]}… sent {msg!r})"
                if before[1] and not after[1]:  # a ring member ended it, as it may: let the swarm re-plan
                    with trio.move_on_after(20):
                        await swarm.ready()
        nursery.cancel_scope.cancel()


# every role sends every op about the live epoch once, in an order where the harmless come first
SWEEP: list[tuple[str, tuple[Any, ...]]] = [
    (role, op)
    for op in [("status",), ("current",), ("plan", "cur+1", True, "self"), ("plan", "cur+1", False, "leader-ring"),
               ("connect", "cur"), ("serve", "cur"), ("ended", "cur"), ("ended", "cur+1"), ("ended", "cur"),
               ("fault", "stage", "cur", "x"), ("fault", "coordinator", "cur", "x"), ("leaving",), ("leave",)]
    for role in ROLES_DRAWN
]  # fmt: skip


def test_every_role_sends_every_op_and_changes_only_what_it_may(ckpt: Path) -> None:
    trio.run(_run, ckpt, SWEEP, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seq=steps)
def test_no_message_from_any_role_crashes_a_node_or_changes_what_its_role_may_not(ckpt: Path, seq: list[Any]) -> None:
    trio.run(_run, ckpt, seq, clock=trio.testing.MockClock(autojump_threshold=0))
