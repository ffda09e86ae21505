"""A re-plan that moves this node's block frees the old block before the new one loads
(Models.stage, node/compute/runtime.py), so a peer never holds both: its budget counts one."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm.errors import ModelError
from swarm.model.stage import Stage
from swarm.node.compute.runtime import Compute, Models
from swarm.node.notices import Hooks, Notices
from swarm.node.settings import NodeSettings
from swarm.testing.checkpoints import TinySpec, write_checkpoint


async def test_the_old_block_is_gone_before_the_new_one_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even while someone still holds the old Stage (the ended epoch's worker, until its task
    unwinds: in a node process that came after the new load had begun), its weights and caches
    are gone before the new block's first tensor is read."""
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4), seed=0)
    settings = NodeSettings(seed=b"s" * 32, swarm_id="s", secret=b"x" * 32, model_dir=ckpt, dtype=torch.float32)
    models = Models(settings, Compute(threads=False), Notices(Hooks()))
    held = await models.stage(0, 2)  # a worker of the old epoch keeps this reference
    assert await models.stage(0, 2) is held  # the same block again: kept, not reloaded
    held.open_session("s", 8)
    held.forward("s", torch.zeros(1, held.args.dim))  # the session's KV tensors are allocated
    weights = [weakref.ref(t) for t in [*held.parameters(), *held._cache("s")._k.values()]]
    alive_at_load: list[int] = []
    real = Stage.load

    def load(*args: Any, **kw: Any) -> Stage:
        alive_at_load.append(sum(w() is not None for w in weights))
        return real(*args, **kw)

    monkeypatch.setattr(Stage, "load", load)
    new = await models.stage(0, 3)
    assert len(weights) > 2 and alive_at_load == [0] and new.end == 3
    with pytest.raises(ModelError, match="released"):
        held.open_session("t", 8)
    with pytest.raises(ModelError, match="no session"):
        held.forward("s", torch.zeros(1, held.args.dim))


async def test_a_block_asked_for_again_while_it_loads_is_loaded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: a re-plan while a peer loads its block (the new epoch gives it the same one) set
    a second load going beside the first; the peer held two copies and was OOM-killed inside its
    offer. The second ask now gets the first load's block, whatever became of the first asker
    (here cancelled: the ended epoch's set-up)."""
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4), seed=0)
    settings = NodeSettings(seed=b"s" * 32, swarm_id="s", secret=b"x" * 32, model_dir=ckpt, dtype=torch.float32)
    models = Models(settings, Compute(threads=True), Notices(Hooks()))
    gate, loads = threading.Event(), []
    real = Stage.load

    def load(*args: Any, **kw: Any) -> Stage:
        loads.append(args[2:4])
        gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(Stage, "load", load)
    got: list[Stage] = []
    first = trio.CancelScope()

    async def ended_epoch() -> None:  # its set-up is cancelled mid-load
        with first:
            await models.stage(0, 2)

    async def next_epoch() -> None:
        got.append(await models.stage(0, 2))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ended_epoch)
        while not loads:
            await trio.sleep(0.01)
        nursery.start_soon(next_epoch)
        await trio.sleep(0.1)
        first.cancel()
        gate.set()
    assert loads == [(0, 2)] and got and got[0] is await models.stage(0, 2)
