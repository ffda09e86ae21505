"""Signing and checking adverts and plans with a node's Ed25519 key; dropping stale adverts.

An advert is signed over ``"shard-swarm/advert/1" \\0 canonical_json(advert.body())``: the swarm ID
and sequence number are inside the signed body, so an advert can be replayed neither into another
swarm nor (thanks to :class:`AdvertBook`) after a newer one. Its ``peer_id`` must be the peer ID
of its ``public_key``, so a member cannot publish under another member's name. The book is
bounded: made-up identities expire and give way, and a connected newcomer takes the place of the
connected peer heard from least recently, never a pinned one (the owner's plan and leader).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any

from swarm.errors import ProtocolError
from swarm.proto.limits import DEFAULT_LIMITS
from swarm.proto.messages import Advert, Plan
from swarm.proto.signing import Signer, peer_id_of, sign_body, verify_body

ADVERT_DOMAIN = "shard-swarm/advert/1"
PLAN_DOMAIN = "shard-swarm/plan/1"


def sign_advert(advert: Advert, signer: Signer) -> Advert:
    """Return ``advert`` with its key, peer ID and signature filled in from ``signer``."""
    filled = dataclasses.replace(
        advert, public_key=signer.public_key, peer_id=peer_id_of(signer.public_key)
    )
    return dataclasses.replace(filled, signature=sign_body(signer, ADVERT_DOMAIN, filled.body()))


def verify_advert(advert: Advert, swarm_id: str) -> None:
    """ProtocolError unless the advert is for ``swarm_id``, names its own key's peer ID, and is
    signed by that key."""
    if advert.swarm_id != swarm_id:
        raise ProtocolError(
            f"advert from {advert.peer_id[:64]} is for another swarm ({advert.swarm_id[:64]!r})"
        )
    if len(advert.public_key) != 32 or peer_id_of(advert.public_key) != advert.peer_id:
        raise ProtocolError(
            f"advert claims peer {advert.peer_id[:64]} but carries another peer's key"
        )
    if not verify_body(advert.public_key, ADVERT_DOMAIN, advert.body(), advert.signature):
        raise ProtocolError(f"advert from {advert.peer_id[:64]}: forged or corrupted signature")


UNCONFIRMED_TTL_S = 60.0  # an advert whose peer never connects to us is forgotten after this


class AdvertBook:
    """The newest verified advert per peer. ``offer`` returns True when the advert is news.

    Any member can sign adverts for identities it makes up, so the book is bounded (``max_peers``)
    and an entry is *unconfirmed* until its peer connects to us (``connected=True`` on offer, or
    :meth:`confirm`). Unconfirmed entries expire after ``unconfirmed_ttl`` (:meth:`expire`), and
    when the book is full a newcomer's advert evicts the oldest unconfirmed one that is not
    pinned: made-up peers never connect, so they can neither stay nor lock a genuine newcomer out
    (a genuine peer's advert arrives on its own link, confirmed).

    A member holding the secret can also connect ``max_peers`` real identities. So when the book
    is full of connected peers, a newcomer that is connected itself evicts the connected entry
    heard from least recently (``last_heard``: the failure detector's clock, gossip.py; without
    it, when the entry's advert was last offered) that is not ``pinned`` (the owner names them:
    the members of the plan it serves and its leader, membership.py). An advert of a peer not
    connected to us still evicts no connected entry (nor a pinned one), and a book full of pinned
    peers refuses every newcomer. Times are the caller's clock (``now``).
    """

    def __init__(
        self, swarm_id: str, revoked: frozenset[str] = frozenset(), *, max_peers: int = DEFAULT_LIMITS.max_peers,
        unconfirmed_ttl: float = UNCONFIRMED_TTL_S, pinned: Callable[[], Collection[str]] = frozenset,
        last_heard: Callable[[str], float | None] | None = None,
    ) -> None:  # fmt: skip
        self.swarm_id = swarm_id
        self.revoked = revoked
        self.max_peers = max_peers
        self.unconfirmed_ttl = unconfirmed_ttl
        self.pinned = pinned  # peers whose entries a connected newcomer never evicts (asked only when full)
        self.last_heard = last_heard  # when a peer was last heard (None: never); default: its last offer
        self._latest: dict[str, Advert] = {}
        self._unconfirmed: dict[str, float] = {}  # peer -> when its first advert was taken
        self._offered: dict[str, float] = {}  # peer -> when its advert was last offered

    def offer(self, advert: Advert, *, now: float = 0.0, connected: bool = True) -> bool:
        """Verify and keep ``advert``; False for a stale or repeated sequence number (ignored);
        ProtocolError for a forged one, a revoked peer, or a full book that it may not make room in.
        ``connected``: its peer is connected to us (else the entry is unconfirmed)."""
        verify_advert(advert, self.swarm_id)
        peer = advert.peer_id
        if peer in self.revoked:
            raise ProtocolError(f"advert from revoked peer {peer}")
        old = self._latest.get(peer)
        if old is not None and advert.seq <= old.seq:
            if connected:
                self._unconfirmed.pop(peer, None)
                self._offered[peer] = now
            return False
        if old is None and len(self._latest) >= self.max_peers:
            self.expire(now)
            if len(self._latest) >= self.max_peers and not self._evict_oldest_unconfirmed():
                if not connected:
                    raise ProtocolError(
                        f"advert from {peer}, which is not connected here: {self.max_peers} connected or "
                        "pinned peers known (limit max_peers)"
                    )
                if not self._evict_least_recently_heard():
                    raise ProtocolError(f"advert from {peer}: {self.max_peers} pinned peers known (limit max_peers)")
        self._latest[peer] = advert
        self._offered[peer] = now
        if connected:
            self._unconfirmed.pop(peer, None)
        elif old is None:
            self._unconfirmed[peer] = now
        return True

    def _evict_oldest_unconfirmed(self) -> bool:
        pinned = set(self.pinned()) if self._unconfirmed else set()
        spare = [p for p in self._unconfirmed if p not in pinned]
        if not spare:
            return False
        self.forget(min(spare, key=lambda p: (self._unconfirmed[p], p)))
        return True

    def _evict_least_recently_heard(self) -> bool:
        """Forget the connected entry heard from least recently that is not pinned (ties: the
        smallest ID); False if every entry is pinned."""
        pinned = set(self.pinned())
        heard = self.last_heard
        if heard is not None:
            when = {p: heard(p) for p in self._latest if p not in pinned}
        else:
            when = {p: self._offered.get(p) for p in self._latest if p not in pinned}
        if not when:
            return False
        self.forget(min(when, key=lambda p: (-math.inf if when[p] is None else when[p], p)))
        return True

    def confirm(self, peer_id: str) -> None:
        """``peer_id`` connected to us: its entry no longer expires."""
        self._unconfirmed.pop(peer_id, None)

    def expire(self, now: float) -> list[str]:
        """Forget unconfirmed entries older than ``unconfirmed_ttl``; the peers forgotten."""
        gone = [p for p, t in self._unconfirmed.items() if now - t >= self.unconfirmed_ttl]
        for p in gone:
            self.forget(p)
        return gone

    def unconfirmed(self) -> list[str]:
        return sorted(self._unconfirmed)

    def get(self, peer_id: str) -> Advert | None:
        return self._latest.get(peer_id)

    def forget(self, peer_id: str) -> None:
        self._latest.pop(peer_id, None)
        self._unconfirmed.pop(peer_id, None)
        self._offered.pop(peer_id, None)

    def peers(self) -> dict[str, Advert]:
        return dict(self._latest)


def _plan_body(plan: Plan, swarm_id: str) -> dict[str, Any]:
    # the swarm ID is signed too: one identity key serves every swarm its user joins, and a plan
    # from one swarm must never be taken in another
    return {"epoch": plan.epoch, "plan": plan.plan, "swarm": swarm_id}


def sign_plan(plan: Plan, signer: Signer, swarm_id: str) -> Plan:
    body = _plan_body(plan, swarm_id)
    return dataclasses.replace(
        plan, signer=signer.public_key, signature=sign_body(signer, PLAN_DOMAIN, body)
    )


def verify_plan(plan: Plan, expected_signer: bytes, swarm_id: str) -> None:
    """ProtocolError unless ``plan`` is signed by ``expected_signer`` (e.g. the coordinator's key)."""
    if plan.signer is None or plan.signature is None:
        raise ProtocolError(f"plan for epoch {plan.epoch} is unsigned")
    if plan.signer != expected_signer:
        raise ProtocolError(
            f"plan for epoch {plan.epoch} is signed by {peer_id_of(plan.signer)}, not the expected peer"
        )
    if not verify_body(plan.signer, PLAN_DOMAIN, _plan_body(plan, swarm_id), plan.signature):
        raise ProtocolError(f"plan for epoch {plan.epoch}: forged or corrupted signature")
