"""A member that tries to make itself coordinator through the leader's catch-up (issue 27, finding 1).

The coordinator sees every prompt in clear, so who it is must be decided by the leader alone.
The attack, against a real 3-process swarm: a rogue member (the real membership code, an
identity ground to sort second, just after the leader's) joins; a ring member is killed; while
the ring is down the rogue tells the leader ``ended`` about an epoch past the one it knows, so
the leader believes it is behind and asks every member what it serves; the rogue answers with a
"previous plan" it wrote itself, naming itself coordinator and sole ring (signed with its own
key). Before the fix the leader took that plan as the previous one and its sticky re-plan kept
the rogue as coordinator. Now a plan from a catch-up is taken only when it is signed, verified,
signed by a leader, and held by a member other than its signer: the honest client's output
equals one box, and no prompt reaches the rogue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.proto import control as ctl
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import sign_plan

from .rogue import identity_between, rogue_member
from .swarmkit import MAX_NEW, PROMPT, LiveSwarm, own_swarm, ready_status

pytestmark = pytest.mark.slow

COORDINATOR_ONLY = 150_000  # bytes: room for the tiny model's head (131 kB), not for one layer (410 kB)


@pytest.fixture(scope="module")
def own(security_ckpt: Path) -> Iterator[LiveSwarm]:
    """A swarm of its own: this test kills one of its nodes."""
    yield from own_swarm(security_ckpt)



def forged_plan_body(rogue: str, n_layers: int) -> dict:  # type: ignore[type-arg]
    return {"cause": "trust me", "n_layers": n_layers, "coordinator": rogue, "ring": [rogue],
            "blocks": {rogue: [0, n_layers]}, "standbys": []}  # fmt: skip


async def test_a_member_cannot_make_itself_coordinator_through_a_catch_up(own: LiveSwarm) -> None:
    sw = own.swarm
    ids = sorted(sw.peer_ids)
    leader = ids[0]
    ident = identity_between(ids[0], ids[1])  # the second-smallest ID: the one a thawed leader listens to
    await ready_status(own, 0)
    async with rogue_member(own, ident, memory_bytes=COORDINATOR_ONLY) as rogue:
        with trio.fail_after(60):
            while True:  # every node sees the rogue as a member
                seen = [rogue.peer_id in (await ready_status(own, i))["members"] for i in range(3)]
                if all(seen):
                    break
                await trio.sleep(0.5)
        st = await ready_status(own, 0)
        epoch, plan = st["epoch"], st["plan"]
        assert rogue.peer_id not in (plan["coordinator"], *plan["ring"]), plan
        n_layers = max(b for _a, b in plan["blocks"].values())
        body = forged_plan_body(rogue.peer_id, n_layers)
        forged = sign_plan(PlanMsg(epoch + 1, body), ident, sw.swarm_id)
        rogue.current_reply = lambda: ctl.NoPlan(forged.epoch, forged.plan, forged.signer, forged.signature)
        victims = [p for p in plan["ring"] if p not in (leader, plan["coordinator"])]
        victims = victims or [p for p in plan["ring"] if p != leader]
        victim = sw.peer_ids.index(victims[0])
        survivor = next(i for i in range(3) if i != victim)

        async def spam_ended() -> None:
            while True:
                with contextlib.suppress(Exception):  # the attacker does not care what it is told
                    await rogue.call(leader, ctl.Ended(epoch + 1), timeout=5)
                await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spam_ended)
            await trio.sleep(0.5)
            sw.kill(victim)
            await trio.sleep(8.0)  # the re-plan, and the rogue's attempts at it
            nursery.cancel_scope.cancel()
        async with client.open_client(sw.addrs[survivor], secret=sw.secret, swarm_id=sw.swarm_id) as (h, p):
            st = await client.wait_ready(h, p, timeout=60)
            got = await client.generate(h, p, prompt_ids=PROMPT, max_new_tokens=MAX_NEW, timeout=60)
        assert st["plan"]["coordinator"] != rogue.peer_id, st["plan"]
        assert got["output_token_ids"] == own.reference, (got["output_token_ids"], own.reference)
        assert not rogue.captured, f"{len(rogue.captured)} generation request(s) reached the rogue"
        assert all(m.plan.get("coordinator") != rogue.peer_id for m in rogue.plans), [m.plan for m in rogue.plans]
        assert rogue.asked_current, "the attack never reached the catch-up (the test proves nothing)"

