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

from swarm.manifest.identity import Identity
from swarm.node import client
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
