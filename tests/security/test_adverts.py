"""Forged and replayed adverts from an admitted peer (a member gone bad, or a stolen invite).

The attacker holds the secret, so it is admitted and may speak ``/shard-swarm/ctl/1``. It sends
node 0 adverts that are forged (another member's peer ID under its own key; a body changed after
signing; another swarm's advert) or replayed (a stale sequence number). What node 0 believes is
read back from its ``status`` (the membership view it plans from): forgeries never enter it, a
stale advert never replaces a newer one, and the ring keeps serving correct output.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import trio

from swarm import client
from swarm.manifest.identity import Identity
from swarm.proto.limits import PROTO_CTL
from swarm.proto.messages import Advert
from swarm.proto.signed import sign_advert

from .swarmkit import LiveSwarm, admitted_attacker, assert_still_serving

pytestmark = pytest.mark.slow

GB = 10**9  # the peers file reports memory_gb in 10^9 bytes


def _advert(ident: Identity, swarm_id: str, seq: int, memory: int) -> Advert:
    unsigned = Advert(peer_id="", public_key=b"", swarm_id=swarm_id, seq=seq, memory_bytes=memory,
                      device_kind="cpu", device_name="attacker", layer_us=100)  # fmt: skip
    return sign_advert(unsigned, ident)


def _view(status: dict[str, Any]) -> dict[str, float]:
    return {p["id"]: p["memory_gb"] for p in status["peers_file"]["peers"]}


async def test_forged_and_replayed_adverts_are_ignored(live: LiveSwarm) -> None:
    sw = live.swarm
    node0, victim = sw.peer_ids[0], sw.peer_ids[1]
    fresh, other = Identity(os.urandom(32)), Identity(os.urandom(32))
    async with admitted_attacker(live, 0) as (h, peer):
        assert peer == node0
        before = await client.status(h, node0)
        view0 = _view(before)
        assert victim in view0
        forged_id = dataclasses.replace(
            _advert(other, sw.swarm_id, 10**15, 999 * GB), peer_id=victim
        )
        tampered = dataclasses.replace(
            _advert(other, sw.swarm_id, 10**15, 1 * GB), memory_bytes=999 * GB
        )
        foreign = _advert(other, "another-swarm", 10**15, 999 * GB)
        newer = _advert(fresh, sw.swarm_id, 1000, 3 * GB)  # the positive control: a valid advert
        stale = _advert(fresh, sw.swarm_id, 500, 7 * GB)
        async with h.open_stream(node0, PROTO_CTL, timeout=10) as fs:
            for adv in (forged_id, tampered, foreign, newer, stale, newer):
                await fs.send(adv.to_frame())
            await trio.sleep(1.0)  # adverts are handled in order; give node 0 a moment
            after = await client.status(h, node0)
        view1 = _view(after)
    # The valid advert was taken (so the channel works and the others were really judged) ...
    assert view1.get(fresh.peer_id) == pytest.approx(3.0), view1
    # ... the stale one (seq 500 < 1000) did not replace it, the forgeries never entered the view,
    assert other.peer_id not in view1
    # ... and the victim's entry is still its own advert, not the one carrying its ID.
    assert view1[victim] == pytest.approx(view0[victim])
    assert sorted(after["members"]) == sorted(before["members"])
    log = sw.log(0)
    assert "carries another peer's key" in log
    assert "forged or corrupted signature" in log
    assert "is for another swarm" in log
    await assert_still_serving(live)


async def test_made_up_adverts_never_lock_a_genuine_newcomer_out(live: LiveSwarm) -> None:
    """A member signs 300 adverts for identities it made up (more than the 256 a book holds) and
    sends them to node 0, which passes them on. They never connect, so they stay unconfirmed: a
    genuine newcomer that then joins is in every node's view, and status still answers."""
    from swarm.net.host import open_host
    from swarm.node.members.gossip import MembershipService
    from swarm.node.members.membership import Membership

    sw = live.swarm
    fakes = [Identity(os.urandom(32)) for _ in range(300)]
    async with admitted_attacker(live, 0) as (h, node0):
        async with h.open_stream(node0, PROTO_CTL, timeout=10) as fs:
            for f in fakes:
                await fs.send(_advert(f, sw.swarm_id, 1, 1 * GB).to_frame())
            await trio.sleep(2.0)
        full = _view(await client.status(h, node0))
    # node 0 took them (its status lists its members and then 32 others, so a made-up crowd
    # cannot make the reply too big to send: with the whole book it was over 64 KiB)
    assert len(full) == len(sw.peer_ids) + 32 and sum(f.peer_id in full for f in fakes) == 32, len(full)
    seed = os.urandom(32)
    newcomer = Identity(seed)
    async with open_host(seed, secret=sw.secret, swarm_id=sw.swarm_id) as host:
        service = MembershipService(host, Membership(newcomer, sw.swarm_id, memory_bytes=2 * GB))
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            service.add_candidate(sw.addrs[0], source="bootstrap")
            seen: list[str] = []
            with trio.move_on_after(30):
                while len(seen) < len(sw.peer_ids):
                    seen = []
                    for i, peer in enumerate(sw.peer_ids):
                        async with client.open_client(sw.addrs[i], secret=sw.secret, swarm_id=sw.swarm_id) as (c, p):
                            if newcomer.peer_id in _view(await client.status(c, p)):
                                seen.append(peer)
                    await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
    assert sorted(seen) == sorted(sw.peer_ids), f"the newcomer is missing from {set(sw.peer_ids) - set(seen)}"
    await assert_still_serving(live)
