"""A client (status, generate) tries every address it was given and is never a member."""

from __future__ import annotations

import socket

import trio

from swarm import client
from swarm.manifest.identity import Identity
from swarm.net.host import open_host
from swarm.node.members.gossip import MembershipService
from swarm.node.members.membership import Membership

SWARM = "0123456789abcdef0123456789abcdef"
SECRET = b"c" * 32


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_client_tries_each_address_in_turn_and_never_joins() -> None:
    ident = Identity(b"\x05" * 32)
    events: list[object] = []
    async with (
        open_host(ident.seed, ["/ip4/127.0.0.1/tcp/0"], secret=SECRET, swarm_id=SWARM) as host,
        trio.open_nursery() as nursery,
    ):
        svc = MembershipService(host, Membership(ident, SWARM, memory_bytes=1 << 30), on_event=events.append)
        await nursery.start(svc.run)
        nobody = Identity(bytes([6]) * 32).peer_id
        dead = f"/ip4/127.0.0.1/tcp/{_dead_port()}/p2p/{nobody}"
        async with client.open_client([dead, host.addrs()[0]], secret=SECRET, swarm_id=SWARM, timeout=20) as (c, peer):
            assert peer == host.peer_id
            await trio.sleep(3.0)  # heartbeats flow (the client echoes them), past the suspect limit
            assert host.is_admitted(c.peer_id)
            assert svc.members() == [] and events == []  # admitted, beating, but no member
        nursery.cancel_scope.cancel()
