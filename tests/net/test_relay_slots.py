"""Relay slots against a relay in its own process (a bootstrap holding the swarm secret).

py-libp2p 0.8.1 keeps a reservation for an hour after its peer disconnects and serves the hop
protocol before admission: four outsiders filled a 4-slot relay and then a member was refused.
Here outsiders get no slot at all, a departed peer's slot is free at once, and one IP address
holds at most ``max_reservations_per_ip`` slots.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID

from swarm.errors import PeerError
from swarm.net.host import open_host
from swarm.net.libp2p_host import build_libp2p_host
from swarm.net.relay import RelayNode, open_relay

SECRET = os.urandom(32)
SWARM = "5107500000000000000000000000abcd"
SCRIPT = Path(__file__).parent / "lab_scripts" / "relay_slots.py"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@contextlib.contextmanager
def _relay(slots: int, per_ip: int) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), SECRET.hex(), SWARM, "--slots", str(slots), "--per-ip", str(per_ip)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("ADDR "), f"the relay did not start: {line!r}"
        yield line.split()[1]
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.asynccontextmanager
async def _member() -> AsyncIterator[RelayNode]:
    async with open_host(os.urandom(32), secret=SECRET, swarm_id=SWARM) as host, open_relay(
        host.libp2p, hole_punch=False, admit=host.dial
    ) as node:  # fmt: skip
        yield node


@contextlib.asynccontextmanager
async def _outsider() -> AsyncIterator[RelayNode]:
    """A plain py-libp2p host with a relay client, and no swarm secret."""
    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    raw = build_libp2p_host(os.urandom(32), [listen])
    async with raw.run([listen]), open_relay(raw, hole_punch=False) as node:
        try:
            yield node
        finally:
            with trio.move_on_after(3):
                await raw.close()


async def _reserves(node: RelayNode, addr: str) -> bool:
    try:
        await node.reserve(addr, timeout=15)
        return True
    except PeerError:
        return False


async def test_outsiders_get_no_slot_and_a_member_still_does() -> None:
    with _relay(slots=4, per_ip=8) as addr:
        async with contextlib.AsyncExitStack() as stack:
            outsiders = [await stack.enter_async_context(_outsider()) for _ in range(4)]
            got: list[bool] = []

            async def attempt(node: RelayNode) -> None:
                got.append(await _reserves(node, addr))

            async with trio.open_nursery() as nursery:
                for node in outsiders:
                    nursery.start_soon(attempt, node)
            assert got == [False] * 4, "an outsider without the secret got a relay slot"
            async with _member() as member:
                assert await _reserves(member, addr), "a member was refused after outsiders tried"


async def test_a_departed_peers_slot_is_free_at_once() -> None:
    with _relay(slots=4, per_ip=8) as addr:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(4):
                assert await _reserves(await stack.enter_async_context(_member()), addr)
            async with _member() as fifth:
                assert not await _reserves(fifth, addr)  # the control: the relay is full
        await trio.sleep(1.0)  # the four left (their connections closed)
        async with _member() as late:
            assert await _reserves(late, addr), "slots of peers that left were still held"


async def test_one_address_holds_at_most_its_share() -> None:
    with _relay(slots=8, per_ip=2) as addr:
        async with _member() as a, _member() as b, _member() as c:
            assert await _reserves(a, addr) and await _reserves(b, addr)
            assert not await _reserves(c, addr), "a third slot went to the same IP address"
            await a.host.disconnect(ID.from_base58(addr.rsplit("/p2p/", 1)[1]))  # one of them leaves
            await trio.sleep(1.0)
            assert await _reserves(c, addr), "the address's slot did not come back when one of its peers left"
