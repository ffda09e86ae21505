"""The door of a SwarmHost: admission, what an unadmitted peer may make the host do, and roles.

Theory of operation
-------------------
:class:`Door` owns everything a host knows about a peer before and at admission: who is admitted
and with which credential (*role*: "member" proved the swarm secret, "client" the client
credential), who is being admitted, which inbound connections still wait, and who is banned.

- Outbound, :meth:`Door.admit_outbound` runs the initiator side of ``swarm.proto.admission`` on
  a fresh ``/shard-swarm/admit/1`` stream; inbound, :meth:`Door.serve_admit` runs the responder.
  A peer that fails is logged (peer ID and reason, never the secret) and disconnected.
- :meth:`Door.gate` stands in front of every other stream handler on the libp2p host (installed
  by ``libp2p_patches.govern_host``): a stream from a peer not yet admitted waits for its
  admission, at most ``admit_timeout``, and is reset if it does not come; a client gets only the
  protocols open to clients.
- Each connection is marked ``pending_admission`` until its peer is admitted (WholeFrameYamux
  then accepts at most PRE_ADMISSION_STREAMS streams on it). At most MAX_PENDING_ADMISSIONS
  inbound peers wait at once: a newcomer evicts the one waiting longest, so a flood of
  identities holds a bounded amount, and an honest peer (admitted in milliseconds) gets in.
  Connections we dial ourselves are never evicted. A watchdog drops any connection not
  admitted within ``admit_timeout`` + 1 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.peer.id import ID

from swarm.errors import AdmissionError, SwarmError
from swarm.net import libp2p_patches
from swarm.net.addrs import conn_addr
from swarm.net.streams import is_foreign_io_error, map_exception
from swarm.proto.admission import MEMBER, Initiator, Responder
from swarm.proto.limits import PROTO_ADMIT

log = logging.getLogger("swarm.net.host")

CLOSE_TIMEOUT = 3.0
MAX_PENDING_ADMISSIONS = 16  # inbound connections waiting for admission at once; past it the oldest is dropped
# what a client-admitted peer may use besides the protocols registered for clients
CLIENT_LIBP2P_PROTOCOLS = frozenset({str(IDENTIFY_PROTOCOL), str(PING_PROTOCOL)})
# streams an admitted peer may hold open at once, every protocol counted (identify included), by
# role: a member's; one client identity's; and every client's together (identities are free)
MEMBER_STREAMS = 256
CLIENT_STREAMS = 8
ALL_CLIENT_STREAMS = 64


@dataclass
class StreamBudget:
    """Open inbound streams by peer and by role, after admission (Door.gate claims one for
    every stream it lets through and gives it back when the handler ends)."""

    by_peer: dict[str, int] = dataclasses.field(default_factory=dict)
    clients: int = 0

    def claim(self, peer: str, role: str | None) -> str | None:
        """None if ``peer`` (admitted as ``role``) may open one more stream, else why not."""
        n = self.by_peer.get(peer, 0)
        if role == MEMBER:
            if n >= MEMBER_STREAMS:
                return f"{MEMBER_STREAMS} streams open (a member's limit)"
        elif n >= CLIENT_STREAMS:
            return f"{CLIENT_STREAMS} streams open (a client's limit)"
        elif self.clients >= ALL_CLIENT_STREAMS:
            return f"clients hold {ALL_CLIENT_STREAMS} streams (every client's together)"
        else:
            self.clients += 1
        self.by_peer[peer] = n + 1
        return None

    def release(self, peer: str, role: str | None) -> None:
        n = self.by_peer.get(peer, 0) - 1
        if n > 0:
            self.by_peer[peer] = n
        else:
            self.by_peer.pop(peer, None)
        if role != MEMBER:
            self.clients -= 1


@dataclass(frozen=True)
class HostEvent:
    """Something happened to a peer. ``kind``: "admitted", "refused" or "disconnected"."""

    kind: str
    peer: str
    addr: str = ""  # remote address of the connection ("/ip4/.../tcp/..."), when known
    reason: str = ""
    outbound: bool = False  # we dialed it
    role: str = MEMBER  # for "admitted": the credential the peer proved ("member" or "client")


@dataclass(frozen=True)
class Credential:
    """What this host proves at admission: the swarm secret (MEMBER) or the client secret plus
    the swarm's member key (CLIENT). Its repr never shows a secret."""

    secret: bytes
    role: str = MEMBER
    member_key: bytes = b""

    def __repr__(self) -> str:
        return f"Credential(role={self.role!r}, secret=<hidden>)"


def peer_of(raw: Any) -> str:
    return str(raw.muxed_conn.peer_id)


async def reset_raw(raw: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
        await raw.reset()


async def close_raw(raw: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
        await raw.close()


class Door:
    """Admission state and procedures of one host (see the module docstring)."""

    def __init__(
        self,
        libp2p_host: Any,
        nursery: trio.Nursery,
        *,
        credential: Credential,
        swarm_id: str,
        local_peer: str,
        revoked: frozenset[str],
        admit_timeout: float,
        emit: Callable[[HostEvent], None],
    ) -> None:
        self._h = libp2p_host
        self._nursery = nursery
        self._cred = credential
        self.swarm_id = swarm_id
        self.local_peer = local_peer
        self.revoked = revoked
        self.admit_timeout = admit_timeout
        self._emit = emit
        self.admitted: dict[str, HostEvent] = {}
        self.banned: dict[str, float] = {}  # peer -> trio time until which it is refused
        self.client_protocols: set[str] = set(CLIENT_LIBP2P_PROTOCOLS)
        self.streams = StreamBudget()
        self._admitting: set[str] = set()
        self._dialing: set[str] = set()  # peers we are dialing (their connections are never evicted)
        self._pending: dict[str, float] = {}  # inbound peers connected, not yet admitted -> since
        self._changed = trio.Event()
        self.closed = False

    def role_of(self, peer: str) -> str | None:
        ev = self.admitted.get(peer)
        return ev.role if ev is not None else None

    def is_banned(self, peer: str) -> bool:
        return self.banned.get(peer, 0.0) > trio.current_time()

    def pending(self) -> list[str]:
        """Inbound peers connected and not yet admitted."""
        return sorted(self._pending)

    @contextlib.contextmanager
    def dialing(self, peer: str) -> Any:
        self._dialing.add(peer)
        try:
            yield
        finally:
            self._dialing.discard(peer)

    async def wait_admitted(self, peer: str, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while peer not in self.admitted:
                await self._changed.wait()
        return peer in self.admitted

    # -- the handshake -----------------------------------------------------------------------

    async def admit_outbound(self, peer: str, addr: str, new_stream: Callable[[], Awaitable[INetStream]]) -> None:
        if peer in self.revoked:
            await self.refuse(peer, addr, "revoked by the swarm's invite")
            raise AdmissionError(f"peer {peer} is revoked by the swarm's invite")
        if peer in self.admitted:
            return
        if peer in self._admitting and await self.wait_admitted(peer, self.admit_timeout):
            return  # the other side was admitting us right now
        self._admitting.add(peer)
        cred = self._cred
        try:
            raw = await new_stream()
            try:
                side = Initiator(
                    secret=cred.secret, swarm_id=self.swarm_id, local_peer=self.local_peer, remote_peer=peer,
                    role=cred.role, member_key=cred.member_key,
                )  # fmt: skip
                with trio.fail_after(self.admit_timeout):
                    await _pump_handshake(raw, peer, side, side.start())
            finally:
                await close_raw(raw)
            self.mark_admitted(peer, addr, outbound=True, role=side.peer_role or MEMBER)
        except trio.TooSlowError:
            reason = f"admission handshake did not finish within {self.admit_timeout:g} s"
            await self.refuse(peer, addr, reason)
            raise AdmissionError(f"peer {peer}: {reason}") from None
        except SwarmError as exc:
            await self.refuse(peer, addr, str(exc))
            if isinstance(exc, AdmissionError):
                raise
            raise AdmissionError(f"peer {peer}: admission failed: {exc}") from None
        finally:
            self._admitting.discard(peer)

    async def serve_admit(self, raw: INetStream) -> None:
        peer = peer_of(raw)
        addr = conn_addr(raw.muxed_conn)
        if self.is_banned(peer):
            await close_raw(raw)
            await self.refuse(peer, addr, "refused for a while after breaking the wire protocol")
            return
        self._admitting.add(peer)
        cred = self._cred
        try:
            side = Responder(
                secret=cred.secret, swarm_id=self.swarm_id, local_peer=self.local_peer,
                remote_peer=peer, revoked=self.revoked, role=cred.role, member_key=cred.member_key,
            )  # fmt: skip

            def admitted() -> None:
                self.mark_admitted(peer, addr, outbound=False, role=side.peer_role or MEMBER)

            with trio.fail_after(self.admit_timeout):
                await _pump_handshake(raw, peer, side, b"", on_admitted=admitted)
        except trio.TooSlowError:
            await self.refuse(peer, addr, f"admission handshake did not finish within {self.admit_timeout:g} s")
        except SwarmError as exc:
            await self.refuse(peer, addr, str(exc))
        except Exception as exc:  # never let a handler error escape into libp2p
            await self.refuse(peer, addr, f"{type(exc).__name__}: {exc}")
        finally:
            self._admitting.discard(peer)
            await close_raw(raw)

    def mark_admitted(self, peer: str, addr: str, *, outbound: bool, role: str) -> None:
        if peer in self.admitted:
            return
        ev = HostEvent("admitted", peer, addr, "", outbound, role)
        self.admitted[peer] = ev
        self._pending.pop(peer, None)
        pid = ID.from_base58(peer)
        for muxed in libp2p_patches.muxed_conns(self._h, pid):
            muxed.pending_admission = False
            muxed.narrow = role != MEMBER  # a client's receive windows never grow past 256 KiB
        self._changed.set()
        self._changed = trio.Event()
        log.info("admitted peer %s (%s, %s%s)", peer, addr or "?", "outbound" if outbound else "inbound",
                 "" if role == MEMBER else f", {role}")  # fmt: skip
        libp2p_patches.identify_now(self._h, pid)
        self._emit(ev)

    async def refuse(self, peer: str, addr: str, reason: str) -> None:
        # Never log the secret: reasons come from swarm.proto.admission, which names fields, not values.
        log.warning("refused peer %s (%s): %s", peer, addr or "?", reason)
        self.admitted.pop(peer, None)
        self._pending.pop(peer, None)
        self._emit(HostEvent("refused", peer, addr, reason))
        await self.disconnect(peer)

    async def disconnect(self, peer: str) -> None:
        """Close every connection to ``peer`` (bounded, never raises)."""
        self.admitted.pop(peer, None)
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT), contextlib.suppress(Exception):
            await self._h.disconnect(ID.from_base58(peer))

    # -- connections -------------------------------------------------------------------------

    def on_connected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        if self.closed:
            return
        if peer in self.admitted:
            conn.muxed_conn.pending_admission = False
            conn.muxed_conn.narrow = self.role_of(peer) != MEMBER
            return
        conn.muxed_conn.pending_admission = True
        if peer not in self._dialing:
            self._pending.setdefault(peer, trio.current_time())
            if len(self._pending) > MAX_PENDING_ADMISSIONS:
                oldest = min(self._pending, key=self._pending.__getitem__)
                del self._pending[oldest]
                reason = f"{MAX_PENDING_ADMISSIONS} connections were waiting for admission; this one the longest"
                with contextlib.suppress(RuntimeError):
                    self._nursery.start_soon(self.refuse, oldest, "", reason)
        with contextlib.suppress(RuntimeError):
            self._nursery.start_soon(self._watchdog, peer, conn_addr(conn))

    def on_disconnected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        with contextlib.suppress(Exception):
            if self._h.get_network().connections.get(conn.muxed_conn.peer_id):
                return  # another connection to the same peer is still up
        self._pending.pop(peer, None)
        ev = self.admitted.pop(peer, None)
        if ev is not None:
            log.info("peer %s disconnected", peer)
            self._emit(HostEvent("disconnected", peer, ev.addr, "connection closed", ev.outbound, ev.role))

    async def _watchdog(self, peer: str, addr: str) -> None:
        """A connection that is not admitted in time is dropped."""
        if await self.wait_admitted(peer, self.admit_timeout + 1.0):
            return
        with contextlib.suppress(Exception):
            if not self._h.get_network().get_connections(ID.from_base58(peer)):
                self._pending.pop(peer, None)
                return
        await self.refuse(peer, addr, f"did not complete admission within {self.admit_timeout:g} s")

    async def gate(self, protocol: str, raw: INetStream, handler: Callable[[INetStream], Awaitable[None]]) -> None:
        """In front of every libp2p stream handler but admission's (libp2p_patches.govern_host):
        a stream from a peer not yet admitted waits for it (bounded) or is reset; a client gets
        only what is open to clients."""
        peer = peer_of(raw)
        if peer not in self.admitted and not await self.wait_admitted(peer, self.admit_timeout):
            log.info("reset a %s stream from %s: it was not admitted within %g s", protocol, peer, self.admit_timeout)
            await reset_raw(raw)
            return
        role = self.role_of(peer)
        if role != MEMBER and protocol not in self.client_protocols:
            log.warning("refused %s stream from %s: a client may not use it", protocol, peer)
            await reset_raw(raw)
            return
        full = self.streams.claim(peer, role)
        if full is not None:
            log.warning("refused %s stream from %s: %s", protocol, peer, full)
            await reset_raw(raw)
            return
        try:
            await handler(raw)
        finally:
            self.streams.release(peer, role)

    def govern(self) -> None:
        """Serve admission on the libp2p host and put every other handler behind :meth:`gate`."""
        libp2p_patches.govern_host(
            self._h, gate=self.gate, open_protocols=frozenset({PROTO_ADMIT}), is_admitted=self.admitted.__contains__
        )
        self._h.set_stream_handler(PROTO_ADMIT, self.serve_admit)


async def _pump_handshake(
    raw: INetStream,
    peer: str,
    side: Initiator | Responder,
    first: bytes,
    on_admitted: Callable[[], None] | None = None,
) -> None:
    """Drive a sans-IO admission side over a raw stream until it is done (caller bounds time).

    ``on_admitted`` runs the moment the side is admitted, *before* its last bytes (the responder's
    RESULT) are sent, so the peer can never open a swarm stream that we would still refuse.
    """
    if first:
        await _write_raw(raw, peer, first)
    while not side.done:
        try:
            data = await raw.read(4096)
        except BaseException as exc:
            if is_foreign_io_error(exc):
                if isinstance(exc, EOFError) or "EOF" in type(exc).__name__:
                    data = b""
                else:
                    raise map_exception(exc, peer, "admission") from None
            else:
                raise
        if not data:
            side.eof()  # raises: the handshake was not finished
            return
        out = side.receive_data(data)
        if side.admitted and on_admitted is not None:
            on_admitted()
        if out:
            await _write_raw(raw, peer, out)
    side.check()


async def _write_raw(raw: INetStream, peer: str, data: bytes) -> None:
    try:
        await raw.write(data)
    except BaseException as exc:
        if is_foreign_io_error(exc):
            raise map_exception(exc, peer, "admission") from None
        raise


__all__ = ["ALL_CLIENT_STREAMS", "CLIENT_LIBP2P_PROTOCOLS", "CLIENT_STREAMS", "MEMBER_STREAMS", "StreamBudget", "MAX_PENDING_ADMISSIONS", "Credential", "Door", "HostEvent"]
