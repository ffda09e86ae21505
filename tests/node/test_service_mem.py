"""What the generation service (node/generation/service.py) answers a client it cannot serve, on
a whole in-memory swarm under the autojump clock, each as a typed failure and none by silence: a
swarm with no plan yet, after the request's own wait; a prompt over the swarm's context; text for
a coordinator without a tokenizer; and a request that asked to wait, served once the ring is up.
(Over real processes: test_context_processes.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.errors import ContextTooLong, PeerError, UsageError
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=4), seed=11)  # no tokenizer


async def test_requests_the_swarm_cannot_serve_fail_typed_and_a_waiting_one_is_served(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4])
        await swarm.start(0)  # it expects two members: no plan until the second comes
        t0 = trio.current_time()
        with pytest.raises(PeerError, match=r"the swarm is not ready \(no plan yet\)"):
            await swarm.generate(0, [1, 2, 3], 4, wait_s=2.0)
        assert 2.0 <= trio.current_time() - t0 < 3.0  # it waited what the request allowed, then said so

        async def second() -> None:
            await trio.sleep(1.0)
            await swarm.start(1)

        nursery.start_soon(second)
        got = await swarm.generate(0, [1, 2, 3], 4, wait_s=60.0, draft="none")  # asked to wait: served
        assert len(got["output_token_ids"]) == 4
        plan = await swarm.ready()
        coord = swarm.index(plan.coordinator)
        ctx = swarm.peers[coord].status()["context_tokens"]  # the invite's, capped by the tiny model's maximum
        n = ctx - 12
        with pytest.raises(ContextTooLong, match=f"{n} tokens and max_new_tokens is 13: {ctx + 1} tokens, over this swarm's context of {ctx}"):
            await swarm.generate(coord, [7] * n, 13)
        got = await swarm.generate(coord, [7] * n, 12, draft="none")  # exactly the context: served
        assert len(got["output_token_ids"]) == 12
        async with swarm.client(coord) as (host, peer):
            with pytest.raises(UsageError, match="no tokenizer: send prompt token ids"):
                await client.generate(host, peer, text="hello", max_new_tokens=2)
        nursery.cancel_scope.cancel()
