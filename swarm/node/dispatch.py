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
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio

from swarm.errors import Forbidden, FrameError, PeerError, PeerTimeout, ProtocolError, SwarmError
from swarm.node.errors_util import first_leaf
from swarm.node.hosting import Host, Stream
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_RING
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
    ctl.BadBytes: MEMBER,  # any member may fetch model bytes from another
    ctl.Gen: CLIENT,
    ctl.Status: CLIENT,
}

Handler = Callable[[str, Any], Awaitable[Message]]
R = TypeVar("R", bound=ctl.Control)
RPC_TIMEOUT_S = 20.0


class Handlers(Mapping[type[Message], Handler]):
    """One protocol's handlers by request type, for a :class:`Dispatcher` built before the
    components that answer: the leader and recovery answer ring requests and send their own
    through a :class:`RingClient` on that dispatcher (the control plane's one cycle). The
    composition root (serving.py) fills it with :meth:`add` and closes it with :meth:`seal`
    before the protocol is served; a type without a role in :data:`ROLES`, a second handler for
    a type, or one added after the seal is a TypeError."""

    def __init__(self, table: Mapping[type[Message], Handler] | None = None) -> None:
        self._table: dict[type[Message], Handler] = {}
        self.sealed = False
        self.add(table or {})

    def add(self, table: Mapping[type[Message], Handler]) -> None:
        if self.sealed:
            raise TypeError(f"handlers for {sorted(t.__name__ for t in table)} added after the seal")
        unknown = set(table) - set(ROLES)
        twice = set(table) & set(self._table)
        if unknown or twice:
            raise TypeError(f"no role declared for {sorted(t.__name__ for t in unknown)}" if unknown
                            else f"a second handler for {sorted(t.__name__ for t in twice)}")  # fmt: skip
        self._table.update(table)

    def seal(self) -> None:
        self.sealed = True

    def __getitem__(self, kind: type[Message]) -> Handler:
        return self._table[kind]

    def __iter__(self) -> Iterator[type[Message]]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class RoleView(Protocol):
    """What the dispatcher needs to know to tell a sender's role (view.MemberView)."""

    peer_id: str

    def admitted_role(self, peer: str) -> str | None: ...

    def members(self) -> list[str]: ...

    def leader(self) -> str: ...


@dataclass
class Dispatcher:
    """Checks each request's sender against :data:`ROLES`, then runs its handler.
    ``epoch_roles(epoch)``: (the signer's peer ID if ``epoch`` is the live current epoch, else
    None; the coordinator and ring members of ``epoch``), ProtocolError for an epoch this node
    does not know (epochs.Epochs.roles)."""

    view: RoleView
    epoch_roles: Callable[[int], tuple[str | None, set[str]]]
    handlers: Mapping[type[Message], Handler]
    what: str  # the protocol, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.handlers, Handlers):
            self.handlers = Handlers(self.handlers)  # every handled type has a role

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
            signer, stages = self.epoch_roles(epoch)
            if role == SIGNER and signer is None:
                raise ProtocolError(f"epoch {epoch} is not current here")
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


class RingClient:
    """Requests to other peers on ``/shard-swarm/ring/1`` (our own go through ``local``)."""

    def __init__(self, host: Host, peer_id: str, local: Dispatcher, *, rpc_timeout: float = RPC_TIMEOUT_S) -> None:
        self.host = host
        self.peer_id = peer_id
        self.local = local
        self.rpc_timeout = rpc_timeout

    async def call(self, peer: str, msg: Message, timeout: float = RPC_TIMEOUT_S) -> Message:
        """One request to ``peer`` and its reply; opening the stream is bounded by RPC_TIMEOUT_S
        (or ``timeout`` if shorter), the reply by ``timeout``."""
        if peer == self.peer_id:
            return await self.local(peer, msg)
        async with self.host.open_stream(peer, PROTO_RING, timeout=min(timeout, self.rpc_timeout)) as fs:
            await fs.send_message(msg)
            return await fs.receive_message(timeout=timeout)

    async def serve(self, peer: str, fs: Stream) -> None:
        """The ring protocol's server: one request, one reply."""
        try:
            msg = await fs.receive_message(timeout=self.rpc_timeout)
        except FrameError:
            raise  # the stream itself is broken: nothing can be answered on it
        except ProtocolError as exc:  # a whole frame that is no valid message: told why
            await fs.send_message(ctl.fail_of(exc))
            return
        reply = await self.local(peer, msg)
        await fs.send_message(reply)

    async def ask_each(
        self, peers: Sequence[str], msg: Message, want: type[R], timeout: float
    ) -> tuple[dict[str, str], dict[str, R], list[str]]:
        """Like :meth:`phase`, but every peer's answer is awaited (each at most ``timeout``), none
        cut short by another's failure, so the asker knows who answered what: each peer's
        "linked" (a ``want`` reply), "failed" (it answered a failure, or could not be asked) or
        "silent" (no answer in time); the ``want`` replies; the failures in words."""
        answers: dict[str, str] = {}
        replies: dict[str, R] = {}
        errors: list[str] = []

        async def one(peer: str) -> None:
            try:
                reply = await self.call(peer, msg, timeout)
            except (PeerTimeout, trio.TooSlowError):
                return  # silent: counted below
            except SwarmError as exc:
                answers[peer] = "failed"
                errors.append(f"{peer}: {exc}")
                return
            if isinstance(reply, want):
                answers[peer], replies[peer] = "linked", reply
                return
            answers[peer] = "failed"
            errors.append(str(reply.error(f"{peer}: ")) if isinstance(reply, ctl.Fail) else f"{peer} answered {reply!r}")

        with trio.move_on_after(timeout + 5):
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(one, p)
        for p in peers:
            if p not in answers:
                answers[p] = "silent"
                errors.append(f"{p} did not answer within {timeout:.0f} s")
        return answers, replies, errors

    async def phase(
        self, peers: Sequence[str], msg: Message, want: type[R], timeout: float, best_effort: Sequence[str] = ()
    ) -> dict[str, R]:
        """Send ``msg`` to every peer and wait for a ``want`` reply from each (the set-up phases);
        ``best_effort`` peers are told too, but not waited for. Their replies, by peer."""
        name = getattr(msg, "OP", "plan")
        replies: dict[str, R] = {}

        async def one(peer: str) -> None:
            replies[peer] = ctl.expect(await self.call(peer, msg, timeout), want, peer, name)

        async def maybe(peer: str) -> None:
            try:
                with trio.move_on_after(self.rpc_timeout):
                    await one(peer)
            except SwarmError as exc:
                log.info("standby %s did not take %s: %s", peer, name, exc)

        try:
            with trio.fail_after(timeout + 5):
                async with trio.open_nursery() as nursery:
                    for p in peers:
                        nursery.start_soon(one, p)
                    for p in best_effort:
                        nursery.start_soon(maybe, p)
        except trio.TooSlowError:
            raise PeerError(f"{name}: no answer from every peer within {timeout:.0f} s") from None
        except BaseExceptionGroup as eg:
            err = first_leaf(eg, SwarmError)
            if err is None:
                raise
            raise err from None
        return replies
