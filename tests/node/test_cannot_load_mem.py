"""A block that does not fit (node/serving.py's ``cannot_load``, node/compute/memory.py), on a
whole in-memory swarm under the autojump clock, every node's loads failing past three layers (the
injected hook, as test_memory_processes.py does for one node process): each refusal lowers that
node's offer by a layer, nobody is benched for it, and the leader plans again until a ring of
blocks that load serves the reference tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from swarm.model.generate import LocalModel, generate
from swarm.node.compute import memory
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

PROMPT = [5, 17, 99, 3]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=6), seed=13)


@pytest.mark.parametrize("fits", [3, 2])
async def test_blocks_that_do_not_load_lower_offers_until_a_ring_serves(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, fits: int
) -> None:
    reference = generate(LocalModel.load(ckpt, stages=1, dtype=torch.float32), PROMPT, eos_token_ids=(),
                         max_new_tokens=6).output_token_ids  # fmt: skip
    monkeypatch.setattr(memory, "INJECT_OOM_LOAD_LAYERS", fits)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[6, 6, 6])
        await swarm.start_all()
        offered = {i: p.service.membership.local.memory_bytes for i, p in swarm.peers.items()}
        plan = await swarm.ready(timeout=300)
        assert max(b - a for a, b in plan.blocks.values()) <= fits
        got = await swarm.generate(0, PROMPT, 6, draft="none")
        now = {i: p.service.membership.local.memory_bytes for i, p in swarm.peers.items()}
        excluded = [dict(p.view.excluded) for p in swarm.peers.values()]
        nursery.cancel_scope.cancel()
    assert got["output_token_ids"] == reference
    assert any(now[i] < offered[i] for i in now) and all(now[i] <= offered[i] for i in now)  # refusals lowered offers
    assert excluded == [{}, {}, {}]  # ... and nobody was benched for them
