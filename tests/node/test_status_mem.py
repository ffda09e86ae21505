"""What a client reads of a serving swarm on ``/shard-swarm/gen/1`` (generation/service.py's
``serve`` and ``status``, generation/report.py's ``Reporter.status``), on a whole in-memory swarm
under the autojump clock: a stage's own status and the coordinator's relayed through it, every
member described (device, the memory its block takes, heartbeat age, path), the node's predicted
peak beside its offer, the ring's capacity, and, once a generation ran, its speed; a request
that is neither gen nor status is answered with a typed Fail. (How the status is cut to its byte
budget is test_status_bounded.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.errors import BadRequest
from swarm.proto import control as ctl
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

PROMPT = [5, 17, 99, 3, 42, 7]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=6), seed=7)


async def test_a_client_reads_a_stages_status_and_the_coordinators_through_it(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[3, 3, 3])
        await swarm.start_all()
        everyone = sorted(swarm.ids)
        # the first plan may come before the last member advertised; the one after has it as a standby
        await swarm.until(lambda: all(p.members() == everyone for p in swarm.peers.values())
                          and (pl := swarm.serving_plan()) is not None and len(pl.standbys) == 1, 60, "planned with all three")  # fmt: skip
        plan = swarm.serving_plan()
        coord = swarm.index(plan.coordinator)
        stage = next(swarm.index(p) for p in plan.ring if p != plan.coordinator)
        await swarm.generate(coord, PROMPT, 8, draft="none")
        async with swarm.client(stage) as (host, peer):
            own = await client.status(host, peer)
            relayed = await client.status(host, peer, coordinator=True)
            with pytest.raises(BadRequest, match="expected a gen or status request"):
                await client.request(host, peer, ctl.Ended(plan.epoch))
        nursery.cancel_scope.cancel()

    assert own["peer_id"] == swarm.ids[stage] and relayed["peer_id"] == plan.coordinator
    for st in (own, relayed):
        assert st["members"] == everyone and st["leader"] == swarm.ids[0]
        assert st["plan"]["standbys"] == list(plan.standbys)
        assert st["epoch"] == plan.epoch
        assert st["plan"]["coordinator"] == plan.coordinator and st["plan"]["ring"] == list(plan.ring)
        assert [(h["from"], h["to"]) for h in st["hops"]] == list(zip([plan.coordinator, *plan.ring], [*plan.ring, plan.coordinator], strict=True))
        assert "truncated" not in st  # a three-node swarm's status fits its budget whole
        info = st["peer_info"]
        assert sorted(info) == sorted(swarm.ids)
        me = st["peer_id"]
        assert info[me]["path"] == "self" and info[me]["heartbeat_age_s"] is None and info[me]["rtt_ms"] is None
        for p in swarm.ids:
            if p != me:
                assert info[p]["path"] == "direct" and 0 <= info[p]["heartbeat_age_s"] < 5  # heard from lately
            assert info[p]["device"].startswith("cpu:")  # kind:name from its advert
            held = p in plan.blocks or p == plan.coordinator
            assert (info[p]["memory_used_bytes"] > 0) == held
        mem = st["memory"]
        assert mem["offered_bytes"] == swarm.settings(swarm.index(me)).memory_bytes
        assert 0 < mem["predicted_peak_bytes"] <= mem["offered_bytes"]  # planned within its offer
        assert st["capacity"]["active"] == 0 and st["capacity"]["queued"] == 0
        assert st["peer_id"] in plan.blocks  # both hold a block: their worker's batching is reported
        assert st["stage"]["chunks"] >= 8 and st["stage"]["tokens"] >= len(PROMPT) + 7 and st["stage"]["errors"] == 0
        # the generation ended: nothing of it is held (issue 26), nothing was evicted
        assert st["held"]["stage"] == {"sessions": 0, "kv_bytes": 0, "queued": 0, "queued_tokens": 0, "tracked": 0}
        assert st["stage"]["evicted"] == 0
    assert relayed["serving"] is True  # the coordinator takes generations (a stage's own is not set)
    # the coordinator ran the generation: its speed and its run are reported; the stage has none
    assert relayed["recent"]["generations"] == 1 and relayed["recent"]["tokens_per_s"] > 0
    assert [r["tokens"] for r in relayed["runs"]] == [8] and own["runs"] == [] and own["recent"] == {}
    assert relayed["capacity"]["sessions"] >= 1
    assert relayed["held"]["coordinator"] == {"sessions": 0, "results_queued": 0, "head_queued": 0, "head_tracked": 0}
    assert own["held"]["coordinator"] is None  # not the coordinator
