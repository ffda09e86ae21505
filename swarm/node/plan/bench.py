"""The leader's bench: one place where a member is left out of plans (issue 27).

Bad activations (a fault report weighed by ``authority.FaultClaims``, recovery.py) and strikes
(``authority.Strikes``: ``ended`` reports past their rate, epoch ends a member's report forced,
set-ups it failed on the leader's own evidence: ``authority.setup_blame``)
lead to the same :meth:`Bench.bench`: the member stays out of plans for EXCLUDE_S, and the
epoch ends now if it is in the ring.
"""

from __future__ import annotations

import logging

import trio

from swarm.node.members.view import MemberView
from swarm.node.plan.authority import EXCLUDE_S, Strikes
from swarm.node.plan.epochs import Epochs
from swarm.proto.text import printable

log = logging.getLogger("swarm.node")


class Bench:
    def __init__(self, peer_id: str, view: MemberView, epochs: Epochs) -> None:
        self.peer_id = peer_id
        self.view = view
        self.epochs = epochs
        self.strikes = Strikes()  # what this node, leading, holds against each member

    def strike(self, peer: str, why: str) -> None:
        """One strike against ``peer``; STRIKES of them within EXCLUDE_S bench it."""
        if peer == self.peer_id or self.view.excluded.get(peer, 0.0) > trio.current_time():
            return  # never ourselves; a benched peer is benched already
        n = self.strikes.strike(peer, trio.current_time())
        if n >= self.strikes.limit:
            self.strikes.forgive(peer)
            self.bench(peer, f"{n} strikes within {EXCLUDE_S:.0f} s, the last: {why}")

    def bench(self, peer: str, reason: str) -> None:
        """Leave ``peer`` out of plans for EXCLUDE_S and end the epoch now if it is in the ring."""
        log.warning("excluding %s from plans for %.0f s: %s", peer, EXCLUDE_S, printable(reason))
        self.view.exclude(peer, EXCLUDE_S)
        ep = self.epochs.current
        if ep is not None and peer in ep.members:
            self.epochs.end(f"peer {peer} misbehaved: {printable(reason)[:200]}")
