"""This node's view of the swarm: who is a member, who leads, who may be planned.

The view is membership's (signed adverts of live, admitted peers: membership.py) plus what this
node decided about some of them: who told it that they leave (never planned, never the leader),
and who the leader benched for misbehaving (left out of plans until a deadline). The leader is
the smallest live member ID that is not leaving, which every peer can tell from its own view.
:meth:`MemberView.kick` wakes the leader loop on any news.
"""

from __future__ import annotations

import trio

from swarm.node.dispatch import role_of
from swarm.node.hosting import Host
from swarm.node.members.failure import PeerState
from swarm.node.members.gossip import MembershipService


class MemberView:
    def __init__(self, peer_id: str, service: MembershipService, host: Host) -> None:
        self.peer_id = peer_id
        self.service = service
        self.host = host
        self.leaving: set[str] = set()  # told us they leave: never planned, never followed
        self.excluded: dict[str, float] = {}  # peer -> trio time until which plans skip it
        self._changed = trio.Event()

    def members(self) -> list[str]:
        """Live members that have advertised (clients that only ask for generations never do),
        this node included, sorted."""
        view = self.service.membership.view()
        return sorted({self.peer_id, *(p for p in self.service.members() if p in view)})

    def suspects(self) -> list[str]:
        """Members not heard from for a while, not (yet) declared lost (failure.py)."""
        detector = self.service.liveness.detector
        return [p for p in self.members() if p != self.peer_id and detector.state(p) is PeerState.SUSPECT]

    def plannable(self) -> list[str]:
        """Members a plan may use: not the ones leaving, nor those recently caught misbehaving."""
        now = trio.current_time()
        return [p for p in self.members() if p not in self.leaving and self.excluded.get(p, 0.0) <= now]

    def leader(self) -> str:
        """The smallest live member ID that is not leaving (a leaving leader hands over to the
        next one; if every member is leaving, the smallest of them)."""
        members = self.members()
        return next((p for p in members if p not in self.leaving), members[0])

    def admitted_role(self, peer: str) -> str | None:
        """"member", "client" or None (not admitted), as the host tells it (dispatch.role_of)."""
        return role_of(self.host, peer, advertised=self.service.membership.get(peer) is not None)

    def memory(self) -> dict[str, int]:
        """Memory each member offers for layers (its advert's)."""
        return {p: a.memory_bytes for p, a in self.service.membership.view().items()}

    def drafts(self) -> dict[str, int]:
        """Draft model bytes each member advertises (the planner counts them where it coordinates)."""
        return {p: a.draft_bytes or 0 for p, a in self.service.membership.view().items()}

    def widths(self) -> dict[str, int]:
        """The width of the values each member serves in, where its advert says (Peer.dtype_bytes)."""
        return {p: a.dtype_bytes for p, a in self.service.membership.view().items() if a.dtype_bytes}

    def exclude(self, peer: str, seconds: float) -> None:
        now = trio.current_time()
        self.excluded = {p: t for p, t in self.excluded.items() if t > now}  # bounded: expired go
        self.excluded[peer] = now + seconds

    def kick(self) -> None:
        """Wake the leader loop once. The event is replaced after being set: one left set would
        make every later wait return at once, and the loop spin."""
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self, timeout: float) -> None:
        """Return on the next kick, or after ``timeout``."""
        with trio.move_on_after(timeout):
            await self._changed.wait()
