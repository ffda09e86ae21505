"""The control plane's dispatch: which role may send each request, and who handles it.

Theory of operation
-------------------
Every request on ``/shard-swarm/ring/1`` and ``/shard-swarm/gen/1`` is one typed message
(``swarm.proto.control``; a plan is a PLAN message). :data:`ROLES` is the one table of who may
send each type; a :class:`Dispatcher` checks the sender's role against it before the handler
runs, and answers a refusal with a ``forbidden`` Fail whose text names the rule. The roles, as
this node sees them (issue 14):

- ``client``: any admitted peer; it may open generations and read status, nothing else.
- ``member``: an admitted peer that holds a member credential (``host.admitted_role``) and
  has advertised; until the host tells members from clients, every peer that advertised is one.
- ``leader``: the member that leads this node's view (the smallest live ID not leaving).
- ``signer``: the peer that signed the plan of the epoch the request names (connect, serve).
- ``stage``: the coordinator or a ring member of the epoch the request names (a fault report;
  ``authority.check_fault_report`` then narrows it to the accuser's own upstream hop).

What a handler raises is answered with :func:`~swarm.proto.control.fail_of`: errors stay typed
from the handler to the requester (``Fail.error``), never matched by their text.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.errors import Forbidden, ProtocolError, SwarmError
from swarm.proto import control as ctl
from swarm.proto.messages import Message
from swarm.proto.messages import Plan as PlanMsg

log = logging.getLogger("swarm.node")

CLIENT, MEMBER, LEADER, SIGNER, STAGE = "client", "member", "leader", "signer", "stage"

# message type -> the role its sender must hold (the one table; SECURITY.md lists it too)
ROLES: dict[type[Message], str] = {
    PlanMsg: LEADER,
    ctl.Connect: SIGNER,
    ctl.Serve: SIGNER,
    ctl.Current: MEMBER,
    ctl.Ended: MEMBER,
    ctl.Leaving: MEMBER,
    ctl.Leave: MEMBER,
    ctl.Fault: STAGE,
    ctl.Gen: CLIENT,
    ctl.Status: CLIENT,
}

Handler = Callable[[str, Any], Awaitable[Message]]


class RoleView(Protocol):
    """What the dispatcher needs to know to tell a sender's role."""

    peer_id: str

    def admitted_role(self, peer: str) -> str | None: ...

    def members(self) -> list[str]: ...

    def leader(self) -> str: ...

    def epoch_roles(self, epoch: int) -> tuple[str, set[str]]:
        """(the signer's peer ID, the coordinator and ring members) of ``epoch``, if it is the
        current epoch here; ProtocolError otherwise."""
        ...


@dataclass
class Dispatcher:
    """Checks each request's sender against :data:`ROLES`, then runs its handler."""

    view: RoleView
    handlers: Mapping[type[Message], Handler]
    what: str  # the protocol, for messages

    def __post_init__(self) -> None:
        unknown = set(self.handlers) - set(ROLES)
        if unknown:
            raise TypeError(f"no role declared for {sorted(t.__name__ for t in unknown)}")

    async def __call__(self, peer: str, msg: Message) -> Message:
        """The reply to ``msg`` from ``peer``: the handler's, or a Fail (never an exception)."""
        try:
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"unexpected {type(msg).__name__} on {self.what}")
            self.check(peer, msg)
            return await handler(peer, msg)
        except SwarmError as exc:
            log.warning("%s request %s from %s failed: %s", self.what, type(msg).__name__, peer, exc)
            return ctl.fail_of(exc)

    def check(self, peer: str, msg: Message) -> None:
        """Forbidden unless ``peer`` holds the role ``msg``'s type requires."""
        role = ROLES[type(msg)]
        name = getattr(msg, "OP", "plan")
        v = self.view
        if peer == v.peer_id:
            return  # our own request, dispatched in-process (the leader's own phases)
        kind = v.admitted_role(peer)
        if kind is None:
            raise Forbidden(f"{name} from {peer}, which is not admitted")
        if role == CLIENT:
            return
        if role in (SIGNER, STAGE):  # the epoch's own roles (their holders are members by the plan)
            epoch = int(msg.epoch)  # type: ignore[attr-defined]  # Connect, Serve, Fault
            signer, stages = v.epoch_roles(epoch)
            if role == SIGNER and peer != signer:
                raise Forbidden(f"{name} for epoch {epoch} from {peer}: only the plan's signer {signer} may send it")
            if role == STAGE and peer not in stages:
                raise Forbidden(
                    f"{name} from {peer}: a peer may report only its own upstream hop, and {peer} holds none "
                    f"in epoch {epoch}"
                )
        if kind != "member" or peer not in v.members():
            raise Forbidden(f"{name} from {peer}, which is not an advertised member")
        if role == LEADER and peer != v.leader():
            raise Forbidden(f"{name} from {peer}: only the leader {v.leader()} may send it")


def role_of(host: Any, peer: str, advertised: bool) -> str | None:
    """A peer's admitted role as the host tells it (``admitted_role``: "member", "client" or
    None); a host that cannot tell yet: every admitted peer that has advertised is a member."""
    tell = getattr(host, "admitted_role", None)
    if tell is not None:
        role: str | None = tell(peer)
        return role
    if not host.is_admitted(peer):
        return None
    return "member" if advertised else "client"
