"""The serving half of a peer (node/serving.py), on a whole in-memory swarm under the autojump
clock: each request on /shard-swarm/ring/1 reaches the component that answers it and only from
the role that may send it; the ring and activation protocols refuse a client while gen/1 serves
one; a block that does not load lowers this peer's offer by one layer (keeping a coordinator's
part) and every member hears it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.errors import BadRequest, Forbidden, PeerError
from swarm.node.serving import Serving
from swarm.planner.budget import predicted_peak
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT, PROTO_RING
from swarm.proto.messages import Plan as PlanMsg
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=4), seed=5)


def _serving(swarm: MemSwarm, i: int) -> Serving:
    serving = swarm.peers[i].serving
    assert isinstance(serving, Serving)
    return serving


def _failed(reply: object, kind: type[Exception], match: str) -> None:
    assert isinstance(reply, ctl.Fail), reply
    with pytest.raises(kind, match=match):
        raise reply.error()


async def test_each_ring_request_reaches_its_component_and_only_from_its_role(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4])
        await swarm.start_all()
        plan = await swarm.ready()
        leader, member = swarm.peers[0], swarm.peers[1]  # node 0 has the smallest ID: it leads and signs
        ring = _serving(swarm, 1).ring
        signed = leader.epoch.msg
        assert signed is not None

        # what we serve (the leader's half): the plan as its leader signed it
        reply = await ring.call(leader.peer_id, ctl.Current())
        assert isinstance(reply, PlanMsg) and reply.epoch == plan.epoch and reply.signature == signed.signature
        # the set-up's requests: only the plan's signer sends them, and only for the epoch it serves
        for msg in (ctl.Connect(plan.epoch), ctl.Serve(plan.epoch, {"0": "direct"})):
            _failed(await ring.call(leader.peer_id, msg), Forbidden, f"only the plan's signer {leader.peer_id}")
        _failed(await ring.call(leader.peer_id, ctl.Connect(plan.epoch + 3)), BadRequest,
                f"epoch {plan.epoch + 3} is not current here")  # fmt: skip
        # a plan is the leader's to send: a member passing one on is refused
        _failed(await ring.call(leader.peer_id, signed), Forbidden, f"only the leader {leader.peer_id}")
        # a generation is not a ring request
        _failed(await ring.call(leader.peer_id, ctl.Gen.checked([1, 2], max_new_tokens=1)), BadRequest,
                "unexpected Gen on /shard-swarm/ring/1")  # fmt: skip
        assert swarm.serving_plan() == plan  # none of that disturbed the ring

        # recovery's half: a member that says it leaves is never planned with again
        assert member.peer_id not in leader.view.leaving
        assert isinstance(await ring.call(leader.peer_id, ctl.Leaving()), ctl.Ack)
        assert member.peer_id in leader.view.leaving
        nursery.cancel_scope.cancel()


async def test_a_client_may_ask_for_generations_and_status_but_opens_no_ring_or_activation_stream(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4])
        await swarm.start_all()
        plan = await swarm.ready()
        async with swarm.client(0) as (host, peer):
            status = await client.status(host, peer)  # gen/1 serves clients
            assert status["epoch"] == plan.epoch
            for protocol in (PROTO_RING, PROTO_ACT):
                with pytest.raises(PeerError):  # the door: members only (a member is answered above)
                    async with host.open_stream(peer, protocol, timeout=5) as fs:
                        await fs.send_message(ctl.Current())
                        await fs.receive_message(timeout=5)
        nursery.cancel_scope.cancel()


async def test_a_block_that_does_not_load_lowers_the_offer_by_a_layer_and_every_member_hears(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4])
        await swarm.start_all()
        await swarm.ready()
        serving, other = _serving(swarm, 1), swarm.peers[0]
        me = swarm.peers[1]
        local = me.service.membership.local
        spec = serving.models.spec.at_width(serving.models.dtype.itemsize)
        draft = local.draft_bytes or 0
        offer = local.memory_bytes

        new = serving.epochs.cannot_load(0, 4, True)  # type: ignore[misc]  # as Epochs._load calls it
        assert me.service.membership.local.memory_bytes == new
        assert new <= offer - spec.bytes_per_layer  # at least a layer less, so the next plan differs
        # ... but room for three layers and the coordinator's part beside them: it can still coordinate
        assert new >= predicted_peak(spec, (0, 3), coordinator=True, draft_bytes=draft)

        lower = serving.epochs.cannot_load(0, 3, False)  # type: ignore[misc]
        assert lower <= new - spec.bytes_per_layer
        assert lower >= predicted_peak(spec, (0, 2), coordinator=False)
        assert serving.epochs.cannot_load(0, 1, False) == 0  # type: ignore[misc]  # never below nothing
        lowest = me.service.membership.local.memory_bytes
        assert lowest == 0

        def heard() -> bool:
            advert = other.service.membership.view().get(me.peer_id)
            return advert is not None and advert.memory_bytes == lowest

        with trio.move_on_after(0.02):  # at once: well before the next periodic re-advert (gossip.py)
            while not heard():
                await trio.sleep(0.001)
        assert heard()
        nursery.cancel_scope.cancel()
