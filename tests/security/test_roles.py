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

from swarm.node.runtime import PROTO_RING
from swarm.proto.control import Control
from swarm.proto.messages import parse_message

from .swarmkit import LiveSwarm, admitted_attacker, assert_still_serving, current_plan

pytestmark = pytest.mark.slow


async def _ask(h, target: str, msg: Control) -> Control:  # type: ignore[no-untyped-def]
    async with h.open_stream(target, PROTO_RING, timeout=10) as fs:
        await fs.send(msg.to_frame())
        reply = parse_message(await fs.receive(timeout=15))
    assert isinstance(reply, Control), reply
    return reply


async def test_a_party_without_a_role_is_refused_every_ring_op(live: LiveSwarm) -> None:
    before = await current_plan(live)
    epoch, coordinator = before["epoch"], before["coordinator"]
    attacks = [
        (Control("fault", {"peer": coordinator, "epoch": epoch, "reason": "framed"}), ("only its own upstream", "not the leader")),
        (Control("connect", {"epoch": epoch}), ("only the plan's signer",)),
        (Control("serve", {"epoch": epoch}), ("only the plan's signer", "not the coordinator")),
        (Control("ended", {"epoch": (1 << 62) - 1}), ("not an advertised member",)),
        (Control("leave", {}), ("not an advertised member",)),
    ]
    for i, target in enumerate(live.swarm.peer_ids):
        async with admitted_attacker(live, i) as (h, _peer):
            for msg, reasons in attacks:
                reply = await _ask(h, target, msg)
                text = str(reply.body.get("message", ""))
                assert reply.op == "fail" and any(r in text for r in reasons), (target, msg.op, reply)
    after = await current_plan(live)
    assert after["epoch"] == epoch and after["coordinator"] == coordinator, (before, after)
    assert "excluding" not in live.logs()
    await assert_still_serving(live)
    assert (await current_plan(live))["epoch"] == epoch  # no second worker broke the ring
