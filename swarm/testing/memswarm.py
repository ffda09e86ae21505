"""A whole swarm of real nodes in one trio run, on the in-memory network (for fast tests).

Every node is built by the same composition root as ``shard-swarm join``
(``swarm.node.peer.open_peer``), with a :class:`~swarm.testing.memnet.MemHost` for a host, torch
work inline (so trio's mock clock never jumps while a forward runs) and its own clock (which a
frozen node's stands still on). Under ``autojump_clock`` the swarm's seconds cost no real time:
heartbeats, suspicion, settle times and timeouts run as they do between machines, only faster.

``MemSwarm`` starts nodes (node 0 is everyone's bootstrap), kills, freezes, thaws and
partitions them, waits for a state (a serving ring, a member seen) without sleeping in real
time, and runs generations through a client host, exactly as ``shard-swarm generate`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from swarm import client
from swarm.manifest.identity import Identity
from swarm.model.config import ModelArgs
from swarm.node.compute.runtime import Compute
from swarm.node.errors_util import unwrap
from swarm.node.members.heartbeat import Liveness, serve_ctl_inbound
from swarm.node.notices import Hooks
from swarm.node.peer import Peer, run_peer
from swarm.node.settings import NodeSettings, model_spec, peak_bytes
from swarm.proto.limits import PROTO_CTL
from swarm.testing.memnet import MemHost, MemNet

SWARM_ID = "mem-swarm"
SECRET = b"memory-swarm-secret!"


@dataclass
class MemSwarm:
    """Nodes of one swarm on ``net``; ``layers[i]``: how many layers node i's memory holds."""

    net: MemNet
    ckpt: Path
    nursery: trio.Nursery
    layers: list[int]
    chunk_timeout: float = 3.0
    overrides: dict[int, dict[str, Any]] = field(default_factory=dict)  # NodeSettings fields, per node
    ms_per_layer: dict[int, float] = field(default_factory=dict)  # what node i advertises (default 0.05)
    seeds: list[bytes] = field(default_factory=list)
    peers: dict[int, Peer] = field(default_factory=dict)
    scopes: dict[int, trio.CancelScope] = field(default_factory=dict)
    events: dict[int, list[str]] = field(default_factory=dict)  # each node's notices and life events

    def __post_init__(self) -> None:
        # seeds in peer-ID order: node 0 is the smallest ID (the first leader) and the bootstrap
        pairs = sorted((Identity(s).peer_id, s) for s in (os.urandom(32) for _ in self.layers))
        self.seeds = [s for _, s in pairs]
        self.ids = [p for p, _ in pairs]
        args = ModelArgs.from_dir(self.ckpt)
        self.args = args
        self.spec = model_spec(args, torch.bfloat16, 512, sessions=NodeSettings.sessions)  # the planner's unit

    def memory(self, layers: int) -> int:
        """An offer (fp32, CPU) that holds ``layers`` layers and the coordinator's part: planner/budget.py."""
        return peak_bytes(self.args, torch.float32, "cpu", self.spec, (0, layers), coordinator=True) + 2

    def settings(self, i: int) -> NodeSettings:
        return dataclasses.replace(self._settings(i), **self.overrides.get(i, {}))

    def _settings(self, i: int) -> NodeSettings:
        return NodeSettings(
            seed=self.seeds[i], swarm_id=SWARM_ID, secret=SECRET, model_dir=self.ckpt, listen=(),
            bootstrap=(f"/memory/{self.ids[0]}/p2p/{self.ids[0]}",), memory_bytes=self.memory(self.layers[i]),
            dtype=torch.float32, threads=1, expect_peers=len(self.layers), context_tokens=512,
            chunk_timeout=self.chunk_timeout, fastpath=False,
        )  # fmt: skip

    async def start(self, i: int) -> Peer:
        """Start node ``i`` (again, after a kill: same key, as a user restarting ``join``)."""
        log = self.events.setdefault(i, [])
        hooks = Hooks(on_event=log.append, on_life=lambda ev: log.append(f"life {ev}"))
        peer: Peer = await self.nursery.start(functools.partial(self._run, i, hooks))
        self.peers[i] = peer
        return peer

    async def _run(self, i: int, hooks: Hooks, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self.scopes[i] = scope
            await run_peer(
                self.settings(i), hooks=hooks, open_host=self.net.opener(), compute=Compute(threads=False),
                ms_per_layer=self.ms_per_layer.get(i, 0.05), clock=self.net.clock(self.ids[i]), task_status=task_status,
            )  # fmt: skip

    async def start_all(self) -> None:
        for i in range(len(self.layers)):
            await self.start(i)

    def kill(self, i: int) -> None:
        """Node ``i`` dies (SIGKILL): its connections close at once."""
        self.scopes.pop(i).cancel()
        self.peers.pop(i)

    async def leave(self, i: int) -> None:
        """Node ``i`` leaves on purpose (Ctrl-C): bounded hand-over, then it is gone."""
        await self.peers[i].leave()
        self.kill(i)

    def freeze(self, i: int) -> None:
        self.net.freeze(self.ids[i])

    def thaw(self, i: int) -> None:
        self.net.thaw(self.ids[i])

    def logs(self, i: int) -> str:
        return "\n".join(self.events.get(i, []))

    # -- waiting for a state ---------------------------------------------------------------------

    async def until(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        """Return once ``pred()`` holds; AssertionError after ``timeout`` (swarm) seconds."""
        with trio.move_on_after(timeout):
            while not pred():
                await trio.sleep(0.05)
            return
        raise AssertionError(f"not {what} within {timeout} s:\n" + "\n".join(
            f"--- node {i}: " + self.logs(i)[-1500:] for i in self.peers))  # fmt: skip

    def serving_plan(self, among: list[int] | None = None) -> Any:
        """The plan every live node (or those ``among``) holds, if its coordinator serves it."""
        nodes = [self.peers[i] for i in (among if among is not None else list(self.peers))]
        eps = [p.epoch for p in nodes]
        if any(ep is None or ep.done.is_set() for ep in eps):
            return None
        if len({(ep.plan.epoch, ep.msg.signature if ep.msg else None) for ep in eps}) != 1:
            return None  # not one plan (two halves of a partition may each hold "their" epoch N)
        plan = eps[0].plan
        coord = next((p for p in nodes if p.peer_id == plan.coordinator), None)
        if coord is None or not coord.epoch.serving.is_set():
            return None
        return plan

    async def ready(self, timeout: float = 60.0, among: list[int] | None = None) -> Any:
        await self.until(lambda: self.serving_plan(among) is not None, timeout, "serving one plan")
        return self.serving_plan(among)

    def index(self, peer_id: str) -> int:
        return self.ids.index(peer_id)

    # -- a client -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def client(self, i: int) -> AsyncIterator[tuple[MemHost, str]]:
        """A client host (no member credential, never advertises) admitted to node ``i``."""
        async with self.net.open_host(os.urandom(32), secret=SECRET, swarm_id=SWARM_ID, member=False) as host:
            liveness = Liveness()

            async def ignore(peer: str, advert: Any) -> None:
                return None

            host.handle(PROTO_CTL, lambda peer, fs: serve_ctl_inbound(fs, liveness, ignore))
            peer = await host.dial(f"/memory/{self.ids[i]}/p2p/{self.ids[i]}")
            yield host, peer

    async def generate(self, i: int, prompt: list[int], max_new: int, **kw: Any) -> dict[str, Any]:
        """One generation through a client of node ``i`` (``client.generate``'s keywords); its
        error comes out bare, as ``shard-swarm generate`` would report it."""
        try:
            async with self.client(i) as (host, peer):
                return await client.generate(host, peer, prompt_ids=prompt, max_new_tokens=max_new, **kw)
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
