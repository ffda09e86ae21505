"""The host a node runs on, as an interface: what node/ needs of a network, and nothing more.

The real one is ``swarm.net.host.SwarmHost`` (libp2p, Noise, admission; it satisfies this
structurally); ``swarm.testing.memnet.MemHost`` is an in-memory one, so a whole swarm runs in one
trio run under a mock clock. Everything a node does with its peers goes through these methods:
admission events, framed streams per protocol, dialing and hanging up, and how a peer is reached.

A peer's *role* (member or client, issue 14) comes from the host when it can tell
(``admitted_role``, optional: dispatch.role_of falls back to "advertised means member").
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, overload

import trio

from swarm.proto.frame import Frame
from swarm.proto.limits import Limits
from swarm.proto.messages import Message, Msg


class Stream(Protocol):
    """A framed, bidirectional stream to one peer (every call has a deadline)."""

    peer: str
    limits: Limits

    async def send(self, frame: Frame, timeout: float | None = None) -> None: ...

    async def receive(self, timeout: float | None = None) -> Frame: ...

    async def send_message(self, msg: Message, timeout: float | None = None) -> None:
        """One typed message (its frame is built below node/, in swarm.proto.messages)."""
        ...

    @overload
    async def receive_message(self, timeout: float | None = None, *, view: bool = False) -> Message: ...

    @overload
    async def receive_message(self, timeout: float | None = None, *, expect: type[Msg], view: bool = False) -> Msg:
        """The next message, an ``expect`` or a ProtocolError naming the peer and what came."""
        ...

    @overload
    async def request_message(self, msg: Message, timeout: float | None = None) -> Message: ...

    @overload
    async def request_message(self, msg: Message, timeout: float | None = None, *, expect: type[Msg]) -> Msg: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


Handler = Callable[[str, Any], Awaitable[None]]


class Host(Protocol):
    peer_id: str
    limits: Limits  # the caps its streams decode with

    def addrs(self) -> list[str]:
        """Our dialable addresses, each ending in ``/p2p/<peer id>``."""
        ...

    def handle(self, protocol: str, handler: Handler, *, roles: Iterable[str] = ("member",)) -> None:
        """Serve ``protocol``: ``handler(peer, stream)`` for each inbound stream of a peer admitted
        with one of ``roles`` (default members only; the generation protocol adds "client")."""
        ...

    def open_stream(
        self, peer: str, protocol: str, *, timeout: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """A :class:`Stream` to an admitted peer (AdmissionError for any other)."""
        ...

    def subscribe(self, max_buffer: int = 256) -> trio.MemoryReceiveChannel[Any]:
        """Every later HostEvent (admitted, refused, disconnected)."""
        ...

    def is_admitted(self, peer: str) -> bool: ...

    def admitted_peers(self) -> list[str]: ...

    def admission_info(self, peer: str) -> Any:
        """The "admitted" HostEvent of a peer (address, direction), or None."""
        ...

    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        """Connect and run admission; the peer's ID."""
        ...

    async def disconnect(self, peer: str) -> None: ...

    def has_other_connection(self, peer: str, stream: Any) -> bool:
        """Whether ``peer`` is reached by another connection than ``stream``'s (DCUtR)."""
        ...

    def path_label(self, peer: str) -> str:
        """How ``peer`` is reached: "direct", "hole-punched", "relayed via <relay>", "none"."""
        ...

    async def settle_path(self, peer: str, *, timeout: float) -> None:
        """Let a hole punch to ``peer`` finish (bounded) before a long-lived stream opens."""
        ...


if TYPE_CHECKING:  # mypy checks that the real host is one

    def _the_real_host_is_a_host(h: Any) -> Host:
        from swarm.net.host import SwarmHost

        real: SwarmHost = h
        return real
