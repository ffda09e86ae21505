"""A member gone bad, as a real libp2p host in the test process (issue 27).

It holds the swarm secret and runs the real membership code (``MembershipService``): it is
admitted, advertises itself (signed, with the memory it chooses), answers heartbeats and
measures RTTs, so every node sees it as a live member. On the ring protocol it answers what
a compliant peer would (``loaded``, ``linked``, ``serving``) and, when asked what it serves
(``current``), the answer the test gives it. It accepts activation streams without serving
them, and records every generation request that reaches it (a captured prompt).

Nothing here forwards activations: the rogue never takes part in a working ring, so an honest
generation that completes did not pass through it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.manifest.identity import Identity
from swarm.net.host import open_host
from swarm.node.members.gossip import MembershipService
from swarm.node.members.membership import Membership
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT, PROTO_GEN, PROTO_RING
from swarm.proto.messages import Message, parse_message
from swarm.proto.messages import Plan as PlanMsg

from .swarmkit import LiveSwarm


def identity_between(lo: str, hi: str) -> Identity:
    """An identity whose peer ID sorts strictly between ``lo`` and ``hi`` (ground like an
    attacker would: IDs are free to make)."""
    while True:
        ident = Identity(os.urandom(32))
        if lo < ident.peer_id < hi:
            return ident


@dataclass
class Rogue:
    ident: Identity
    host: Any = None
    service: MembershipService | None = None
    current_reply: Callable[[], Message] = ctl.NoPlan
    asked_current: list[str] = field(default_factory=list)
    plans: list[PlanMsg] = field(default_factory=list)  # plans a leader sent it
    captured: list[ctl.Gen] = field(default_factory=list)  # generation requests that reached it
    ring_ops: list[str] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.ident.peer_id

    async def call(self, peer: str, msg: Message, timeout: float = 10.0) -> Message:
        async with self.host.open_stream(peer, PROTO_RING, timeout=timeout) as fs:
            await fs.send(msg.to_frame())
            return parse_message(await fs.receive(timeout=timeout))

    async def _ring(self, peer: str, fs: Any) -> None:
        msg = parse_message(await fs.receive(timeout=10))
        reply: Message
        self.ring_ops.append(type(msg).__name__)
        if isinstance(msg, ctl.Current):
            self.asked_current.append(peer)
            reply = self.current_reply()
        elif isinstance(msg, PlanMsg):
            self.plans.append(msg)
            reply = ctl.Loaded(msg.epoch)
        elif isinstance(msg, ctl.Connect):
            reply = ctl.Linked()
        else:
            reply = ctl.Ack()
        await fs.send(reply.to_frame())

    async def _act(self, peer: str, fs: Any) -> None:
        with trio.move_on_after(60):
            while True:
                await fs.receive(timeout=60)

    async def _gen(self, peer: str, fs: Any) -> None:
        msg = parse_message(await fs.receive(timeout=10))
        if isinstance(msg, ctl.Gen):
            self.captured.append(msg)
        await fs.send(ctl.Fail("busy", "rogue").to_frame())


@contextlib.asynccontextmanager
async def rogue_member(
    ls: LiveSwarm, ident: Identity, *, memory_bytes: int, takes_hops: bool = True, **membership: Any
) -> AsyncIterator[Rogue]:
    """A rogue member joined through node 0, until the block exits. ``takes_hops=False``: it
    serves no activation protocol at all (it never opens its hops, and refuses those into it)."""
    sw = ls.swarm
    rogue = Rogue(ident)
    async with open_host(ident.seed, ("/ip4/127.0.0.1/tcp/0",), secret=sw.secret, swarm_id=sw.swarm_id) as host:
        rogue.host = host
        service = MembershipService(
            host, Membership(ident, sw.swarm_id, memory_bytes=memory_bytes, addrs=host.addrs(), **membership)
        )
        rogue.service = service
        host.handle(PROTO_RING, rogue._ring)
        if takes_hops:
            host.handle(PROTO_ACT, rogue._act)
        host.handle(PROTO_GEN, rogue._gen)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            for a in sw.addrs:
                service.add_candidate(a, source="bootstrap")
            yield rogue
            nursery.cancel_scope.cancel()
