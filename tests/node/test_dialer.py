"""Membership's dialer (node/members/gossip.py ``add_candidate`` and the dial loop), on a mock
clock with a host that records dials: which addresses are worth dialing, how often a silent one
is retried (doubling back-off up to MAX_BACKOFF), who dials when two peers learned of each other
from adverts (the lower ID; the higher waits DIAL_GRACE), and that a learned address nobody
answers on is forgotten while one the user gave is kept. Gossip itself: test_membership.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from swarm.errors import PeerError, UsageError
from swarm.manifest.identity import Identity
from swarm.node.members.gossip import CANDIDATE_TTL_S, DIAL_GRACE, MAX_BACKOFF, MembershipService
from swarm.node.members.membership import Membership

SWARM = "0123456789abcdef0123456789abcdef"
IDS = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)  # IDS[0] has the smallest ID


class _Host:
    """Dials succeed only to peers in ``up``; every try is recorded with its trio time."""

    def __init__(self, me: Identity) -> None:
        self.peer_id = me.peer_id
        self.up: set[str] = set()
        self.admitted: set[str] = set()
        self.dials: list[tuple[float, str]] = []

    def subscribe(self) -> trio.MemoryReceiveChannel[object]:
        self._events, recv = trio.open_memory_channel[object](10)
        return recv

    def handle(self, protocol: str, handler: object) -> None:
        pass

    def admitted_peers(self) -> list[str]:
        return sorted(self.admitted)

    def is_admitted(self, peer: str) -> bool:
        return peer in self.admitted

    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        peer = addr.rsplit("/p2p/", 1)[-1]
        self.dials.append((trio.current_time(), peer))
        await trio.sleep(0.01)
        if peer not in self.up:
            raise PeerError(f"nothing answers at {addr}")
        self.admitted.add(peer)
        return peer


def _addr(ident: Identity, port: int = 4001) -> str:
    return f"/ip4/10.0.0.9/tcp/{port}/p2p/{ident.peer_id}"


@asynccontextmanager
async def _service(me: Identity) -> AsyncIterator[tuple[MembershipService, _Host]]:
    host = _Host(me)
    service = MembershipService(host, Membership(me, SWARM, device=("cpu", "t")), interval=1.0)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        yield service, host
        nursery.cancel_scope.cancel()


def test_the_hosts_and_the_signers_identity_must_be_one() -> None:
    with pytest.raises(UsageError, match="one seed for both"):
        MembershipService(_Host(IDS[0]), Membership(IDS[1], SWARM, device=("cpu", "t")))  # type: ignore[arg-type]


async def test_only_dialable_addresses_of_others_are_candidates(autojump_clock: trio.testing.MockClock) -> None:
    async with _service(IDS[1]) as (service, host):
        with pytest.raises(UsageError, match="mdns address '/ip4/10.0.0.9/tcp/1' lacks /p2p/<peer id>"):
            service.add_candidate("/ip4/10.0.0.9/tcp/1", source="mdns")
        service.add_candidate(_addr(IDS[1]))  # ourselves
        service.add_candidate(f"/ip4/0.0.0.0/tcp/4001/p2p/{IDS[2].peer_id}")  # a wildcard reaches our own listener
        host.up.add(IDS[2].peer_id)
        service.add_candidate(_addr(IDS[2]))
        service.add_candidate(_addr(IDS[2]))  # the same address twice: one candidate
        await trio.sleep(10)
    assert host.dials == [(pytest.approx(0.0, abs=0.6), IDS[2].peer_id)]  # dialed once, then admitted


async def test_a_silent_address_is_retried_with_a_doubling_back_off(autojump_clock: trio.testing.MockClock) -> None:
    async with _service(IDS[1]) as (service, host):
        service.add_candidate(_addr(IDS[0]), source="bootstrap")
        await trio.sleep(30)
        host.up.add(IDS[0].peer_id)
        await trio.sleep(10)
        n = len(host.dials)
        await trio.sleep(30)
        assert len(host.dials) == n  # admitted: never dialed again
    gaps = [b - a for (a, _), (b, _) in zip(host.dials, host.dials[1:], strict=False)]
    assert gaps[:3] == pytest.approx([0.5, 1.0, 2.0], abs=0.5)  # doubling ...
    assert max(gaps) <= MAX_BACKOFF + 0.6 and gaps[-2] == pytest.approx(MAX_BACKOFF, abs=0.6)  # ... up to the cap


async def test_two_peers_that_learned_of_each_other_are_dialed_by_the_lower_id(autojump_clock: trio.testing.MockClock) -> None:
    async with _service(IDS[2]) as (service, host):  # the higher ID of the pair
        service.add_candidate(_addr(IDS[0]), source="advert")
        await trio.sleep(DIAL_GRACE - 0.6)
        assert host.dials == []  # the lower peer dials us first, as a rule
        await trio.sleep(1.5)
        assert host.dials and {p for _, p in host.dials} == {IDS[0].peer_id}  # it did not: we dial, after the grace
        assert DIAL_GRACE <= host.dials[0][0] <= DIAL_GRACE + 0.6
    async with _service(IDS[0]) as (service, host):  # the lower ID dials at once
        t0 = trio.current_time()
        service.add_candidate(_addr(IDS[2]), source="advert")
        await trio.sleep(0.6)
        assert host.dials[0][1] == IDS[2].peer_id and host.dials[0][0] - t0 <= 0.5  # its first dial round


async def test_a_learned_address_nobody_answers_on_is_forgotten_and_a_given_one_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _service(IDS[0]) as (service, host):
        service.add_candidate(_addr(IDS[1]), source="mdns")
        service.add_candidate(_addr(IDS[2]), source="bootstrap")
        await trio.sleep(CANDIDATE_TTL_S + 5)
        before = {p: sum(1 for _, q in host.dials if q == p) for p in (IDS[1].peer_id, IDS[2].peer_id)}
        await trio.sleep(60)
        after = {p: sum(1 for _, q in host.dials if q == p) for p in before}
    assert after[IDS[1].peer_id] == before[IDS[1].peer_id] > 0  # forgotten after CANDIDATE_TTL_S
    assert after[IDS[2].peer_id] > before[IDS[2].peer_id]  # the bootstrap is tried for good
