"""Shared parts of the adversarial tests: one real multi-process swarm, attackers, the reference.

Starting a swarm costs ~25 s on this machine, so every multi-process test in this package shares
one session-scoped 3-node swarm (fp32, a seeded tiny checkpoint, real ``python -m swarm.node``
processes on loopback). Each attack ends by checking that an honest client still gets output
identical to the in-process reference (``swarm.model.generate`` on the same checkpoint).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm import client
from swarm.launch import LocalSwarm, start_local_swarm
from swarm.model.generate import LocalModel, generate
from swarm.net.host import SwarmHost, open_host
from swarm.testing.checkpoints import TinySpec, write_checkpoint

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
MAX_NEW = 16


@dataclass
class LiveSwarm:
    """The shared swarm, its checkpoint, and what honest clients received so far."""

    swarm: LocalSwarm
    ckpt: Path
    reference: list[int]
    receipts: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(self.swarm.log(i) for i in range(len(self.swarm.procs)))


def reference_output(ckpt: Path, prompt: list[int] = PROMPT, max_new: int = MAX_NEW) -> list[int]:
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32)
    return generate(model, prompt, eos_token_ids=(), max_new_tokens=max_new).output_token_ids


@pytest.fixture(scope="session")
def security_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("sec-tiny"), TinySpec(n_layers=4, row_gain_spread=1.0), seed=3
    )


@pytest.fixture(scope="session")
def live(security_ckpt: Path) -> Iterator[LiveSwarm]:
    ref = reference_output(security_ckpt)
    swarm = start_local_swarm(3, security_ckpt, dtype="fp32", chunk_timeout=10.0)
    try:
        ls = LiveSwarm(swarm, security_ckpt, ref)

        async def ready() -> None:
            async with honest_client(ls, 1) as (h, peer):
                ls.statuses.append(await client.wait_ready(h, peer, timeout=120))

        try:
            trio.run(ready)
        except Exception as exc:
            raise RuntimeError(
                f"the shared swarm did not get ready ({exc}); node logs:\n{ls.logs()[-6000:]}"
            ) from None
        yield ls
    finally:
        swarm.stop()


def own_swarm(ckpt: Path, **kw: Any) -> Iterator[LiveSwarm]:
    """A 3-node swarm of one test module's own (for a module-scoped fixture: ``yield from``), for
    attacks that kill nodes and so cannot share ``live``; ``kw`` go to start_local_swarm."""
    swarm = start_local_swarm(3, ckpt, dtype="fp32", chunk_timeout=10.0, **kw)
    try:
        yield LiveSwarm(swarm, ckpt, reference_output(ckpt))
    finally:
        swarm.stop()


async def ready_status(ls: LiveSwarm, node: int) -> dict[str, Any]:
    """Node ``node``'s status once it serves (client.wait_ready)."""
    async with honest_client(ls, node) as (h, peer):
        return await client.wait_ready(h, peer, timeout=120)


@contextlib.asynccontextmanager
async def honest_client(ls: LiveSwarm, node: int = 1) -> AsyncIterator[tuple[SwarmHost, str]]:
    async with client.open_client(
        ls.swarm.addrs[node], secret=ls.swarm.secret, swarm_id=ls.swarm.swarm_id
    ) as hp:
        yield hp


async def assert_still_serving(ls: LiveSwarm, node: int = 1) -> dict[str, Any]:
    """Every node process is alive and an honest generation equals the reference."""
    assert all(ls.swarm.alive()), "a node process died:\n" + ls.logs()[-4000:]
    async with honest_client(ls, node) as (h, peer):
        await client.wait_ready(h, peer, timeout=60)
        got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=MAX_NEW, timeout=60)
        ls.statuses.append(await client.status(h, peer))
    ls.receipts.append(got)
    assert got["output_token_ids"] == ls.reference, (got["output_token_ids"], ls.reference)
    assert all(ls.swarm.alive()), "a node process died:\n" + ls.logs()[-4000:]
    return got


@contextlib.asynccontextmanager
async def admitted_attacker(ls: LiveSwarm, node: int) -> AsyncIterator[tuple[SwarmHost, str]]:
    """A host holding the swarm secret (a member gone bad, or a stolen invite), admitted to ``node``.

    It never advertises, so it never becomes part of a plan; it answers heartbeats so the node
    keeps it connected (the same as ``client.open_client``)."""
    async with client.open_client(
        ls.swarm.addrs[node], secret=ls.swarm.secret, swarm_id=ls.swarm.swarm_id
    ) as hp:
        yield hp


@contextlib.asynccontextmanager
async def outsider(
    secret: bytes | None = None, swarm_id: str = "outsider"
) -> AsyncIterator[SwarmHost]:
    """A correctly built host that does not hold the swarm's secret."""
    async with open_host(
        os.urandom(32), secret=secret or os.urandom(32), swarm_id=swarm_id, admit_timeout=3.0
    ) as h:
        yield h


def node_peer_ids(ls: LiveSwarm) -> list[str]:
    return list(ls.swarm.peer_ids)


async def current_plan(ls: LiveSwarm) -> dict[str, Any]:
    async with honest_client(ls, 1) as (h, peer):
        st = await client.wait_ready(h, peer, timeout=60)
    plan = st["plan"]
    assert plan is not None
    return {"epoch": st["epoch"], **plan}


__all__ = [
    "LiveSwarm",
    "MAX_NEW",
    "PROMPT",
    "admitted_attacker",
    "assert_still_serving",
    "current_plan",
    "honest_client",
    "node_peer_ids",
    "outsider",
    "reference_output",
]
