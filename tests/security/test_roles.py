"""Authority behind the door (issue 14): an admitted party that is not entitled to a ring op.

The attacker holds the swarm secret (a stolen invite, or a plain `generate` client gone bad)
but holds no role in the plan. Against every node of the real 3-process swarm it sends what
only a leader, a coordinator or a stage may send: a ``fault`` naming the coordinator,
``connect`` and ``serve`` for the current epoch (which once started a second worker and replaced
the coordinator's send link), ``ended`` with a forged epoch of 2^62, and ``leave``. Every one is
refused with a reason naming the rule, the epoch is unchanged, and an honest generation still
equals the reference.
"""

from __future__ import annotations

import pytest

from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_RING
from swarm.proto.messages import parse_message

from .swarmkit import LiveSwarm, admitted_attacker, assert_still_serving, current_plan

pytestmark = pytest.mark.slow


async def _ask(h, target: str, msg: ctl.Control) -> ctl.Control:  # type: ignore[no-untyped-def]
    async with h.open_stream(target, PROTO_RING, timeout=10) as fs:
        await fs.send(msg.to_frame())
        reply = parse_message(await fs.receive(timeout=15))
    assert isinstance(reply, ctl.Control), reply
    return reply


async def test_a_party_without_a_role_is_refused_every_ring_op(live: LiveSwarm) -> None:
    before = await current_plan(live)
    epoch, coordinator = before["epoch"], before["coordinator"]
    attacks: list[tuple[ctl.Control, tuple[str, ...]]] = [
        (ctl.Fault(coordinator, epoch, "framed"), ("only its own upstream", "not the leader")),
        (ctl.Connect(epoch), ("only the plan's signer",)),
        (ctl.Serve(epoch), ("only the plan's signer", "not the coordinator")),
        (ctl.Ended((1 << 62) - 1), ("not an advertised member",)),
        (ctl.Leave(), ("not an advertised member",)),
        (ctl.Leaving(), ("not an advertised member",)),  # a client is no member: it cannot leave either
        (ctl.Current(), ("not an advertised member",)),  # ... nor read the signed plan a member catches up from
    ]
    for i, target in enumerate(live.swarm.peer_ids):
        async with admitted_attacker(live, i) as (h, _peer):
            for msg, reasons in attacks:
                reply = await _ask(h, target, msg)
                assert isinstance(reply, ctl.Fail), (target, msg, reply)
                assert reply.code == "forbidden" and any(r in reply.message for r in reasons), (target, msg, reply)
    after = await current_plan(live)
    assert after["epoch"] == epoch and after["coordinator"] == coordinator, (before, after)
    assert "excluding" not in live.logs()
    await assert_still_serving(live)
    assert (await current_plan(live))["epoch"] == epoch  # no second worker broke the ring
