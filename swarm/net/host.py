"""The libp2p host: TCP + Noise + yamux only, admission first, framed streams, clean shutdown.

Theory of operation
-------------------
:func:`open_host` builds a py-libp2p 0.8.1 host from the node's 32-byte Ed25519 seed (the same
seed as ``swarm.manifest.identity``, so the peer ID and the advert signatures share one key), with
an explicit Noise-only security table and a yamux-only muxer table: the library's defaults also
accept plaintext, secio and TLS, which would let a dialer claim another peer's ID.
``ConnectionConfig(max_connections_per_peer=1)`` avoids the fixed 250 ms wait in ``connect()``;
the auto-connector's minimums are zeroed so the library never redials a peer we dropped.

py-libp2p's internals that we adapt (whole yamux frame writes, enforced receive windows, the
stream handler gate, the negative dial cache) live in ``libp2p_patches.py``; :func:`build_libp2p_host`
applies them, after checking the installed py-libp2p is the pinned version.

Admission gates everything. A connection is only transport-authenticated (Noise proves the peer
ID); before anything is served to or requested from a peer, both sides prove a credential on
:data:`PROTO_ADMIT` (the sans-IO handshake of ``swarm.proto.admission``): the swarm secret (a
*member*) or the client credential derived from it (a *client*, which may only run generations
and read status). The dialer runs the handshake right after connecting; an inbound peer that has
not completed it within ``admit_timeout`` is disconnected. A peer that fails is logged (peer ID
and reason, never the secret) and disconnected; the other connections never notice.

The door (what an unadmitted peer can make this host do):

- Every stream handler on the libp2p host, ours and py-libp2p's (identify, ping, relay, DCUtR,
  dial-back, fast path), sits behind :meth:`SwarmHost._gate`: a stream from a peer not yet
  admitted waits (at most ``admit_timeout``) for its admission, else it is reset unanswered; only
  the admission protocol is served before. A client gets only the protocols registered for it
  (``handle(..., roles=(MEMBER, CLIENT))``) plus identify and ping.
- An unadmitted connection may open at most ``PRE_ADMISSION_STREAMS`` streams, each stream's
  yamux receive window is enforced (a peer that sends past it is disconnected), and at most
  :data:`MAX_PENDING_ADMISSIONS` inbound connections wait for admission at once (the oldest goes
  first), so parallel identities cannot multiply what one may hold.
- Outbound identify runs only towards admitted peers.

Lifetime: everything runs inside the ``async with open_host(...)`` block's nursery. Leaving it
calls ``host.close()`` *before* leaving ``host.run()`` (py-libp2p leaks connections otherwise),
all under a shielded, bounded cancel scope.

Events (admitted, refused, disconnected) are delivered to every subscriber's memory channel; node/
uses them to drive membership and heartbeats.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import PING_LENGTH
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from swarm.errors import AdmissionError, FrameError, PeerError, SwarmError, UsageError
from swarm.net import libp2p_patches
from swarm.net.addrs import conn_addr, dialable_addrs, is_wildcard, parse_multiaddr, strip_p2p
from swarm.net.libp2p_patches import WholeFrameYamux
from swarm.net.streams import (
    DEFAULT_IO_TIMEOUT,
    FramedStream,
    is_foreign_io_error,
    map_exception,
    open_framed,
)
from swarm.proto.admission import CLIENT, MEMBER, ROLES, Initiator, Responder
from swarm.proto.limits import DEFAULT_LIMITS, PROTO_ADMIT, Limits

log = logging.getLogger("swarm.net.host")

DEFAULT_DIAL_TIMEOUT = 10.0
DEFAULT_ADMIT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 3.0
BAN_S = 300.0  # a peer that sent malformed frames is refused this long
MAX_STREAMS_PER_PEER = 256  # inbound swarm streams (fast-path channels included) one peer may hold open at once
MAX_PENDING_ADMISSIONS = 16  # inbound connections waiting for admission at once; past it the oldest is dropped
# what a client-admitted peer may use besides the protocols registered for clients
CLIENT_LIBP2P_PROTOCOLS = frozenset({str(IDENTIFY_PROTOCOL), str(PING_PROTOCOL)})

Handler = Callable[[str, FramedStream], Awaitable[None]]


@dataclass(frozen=True)
class HostEvent:
    """Something happened to a peer. ``kind``: "admitted", "refused" or "disconnected"."""

    kind: str
    peer: str
    addr: str = ""  # remote address of the connection ("/ip4/.../tcp/..."), when known
    reason: str = ""
    outbound: bool = False  # we dialed it
    role: str = MEMBER  # for "admitted": the credential the peer proved ("member" or "client")


def _peer_of(raw: Any) -> str:
    return str(raw.muxed_conn.peer_id)


async def _reset(raw: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
        await raw.reset()


class _Notifee(INotifee):
    def __init__(self, host: SwarmHost) -> None:
        self._host = host

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._host._on_connected(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._host._on_disconnected(conn)

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class SwarmHost:
    """A running libp2p host that speaks only to admitted peers. Build with :func:`open_host`."""

    def __init__(
        self,
        libp2p_host: Any,
        nursery: trio.Nursery,
        *,
        secret: bytes,
        swarm_id: str,
        revoked: frozenset[str],
        limits: Limits,
        io_timeout: float,
        dial_timeout: float,
        admit_timeout: float,
        role: str = MEMBER,
        member_key: bytes = b"",
    ) -> None:
        self._h = libp2p_host
        self._nursery = nursery
        self._secret = secret
        self.role = role  # the credential this host proves: MEMBER (the swarm secret) or CLIENT
        self._member_key = member_key
        self.swarm_id = swarm_id
        self.revoked = revoked
        self._banned: dict[str, float] = {}  # peer -> trio time until which it is refused
        self._streams: dict[str, int] = {}  # peer -> inbound swarm streams (and fast channels) open now
        self.limits = limits
        self.io_timeout = io_timeout
        self.dial_timeout = dial_timeout
        self.admit_timeout = admit_timeout
        self.peer_id: str = str(libp2p_host.get_id())
        self._admitted: dict[str, HostEvent] = {}
        self._admitting: set[str] = set()
        self._dialing: set[str] = set()  # peers we are dialing (their connections are never evicted)
        self._pending: dict[str, float] = {}  # inbound peers connected, not yet admitted -> since
        self._admitted_changed = trio.Event()
        self._client_protocols: set[str] = set(CLIENT_LIBP2P_PROTOCOLS)
        self._subscribers: list[trio.MemorySendChannel[HostEvent]] = []
        self._closed = False
        self.relay: Any = None  # a RelayNode once attach_relay() ran: circuit dials, path labels

    def __repr__(self) -> str:
        return f"SwarmHost({self.peer_id})"

    # -- addresses and peers -----------------------------------------------------------------

    @property
    def libp2p(self) -> Any:
        """The underlying py-libp2p host, for net/ modules (mDNS, relay, NAT) only."""
        return self._h

    def listen_addrs(self) -> list[str]:
        """The addresses we listen on, as bound (a wildcard stays 0.0.0.0), with ``/p2p/``."""
        out = []
        for a in self._h.get_addrs():
            text = str(a)
            if "/p2p-circuit" in text:
                continue
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        return out

    def addrs(self) -> list[str]:
        """Our dialable multiaddrs, each ending in ``/p2p/<peer id>``: the listen addresses with
        a wildcard (0.0.0.0, ::) replaced by this machine's interface addresses (see
        :func:`dialable_addrs`), then our relay circuit addresses. Never a wildcard: a peer that
        dials 0.0.0.0 reaches its own listener."""
        from swarm.net.mdns import interface_table

        out = dialable_addrs(self.listen_addrs(), interface_table())
        if self.relay is not None:
            out += [a for a in self.relay.circuit_addrs if a not in out]
        return out

    def attach_relay(self, relay: Any) -> None:
        """Use ``relay`` (a running ``swarm.net.relay.RelayNode`` on this host) to dial
        ``/p2p-circuit`` addresses, for our circuit addresses and for path labels."""
        self.relay = relay

    async def settle_path(self, peer: str, *, timeout: float) -> None:
        """Let hole punching to ``peer`` finish (bounded) before a long-lived stream opens: a
        stream on a relayed connection dies when DCUtR's direct one replaces it."""
        if self.relay is not None:
            with contextlib.suppress(SwarmError):
                await self.relay.settle(peer, timeout=timeout)

    def path_label(self, peer: str) -> str:
        """How ``peer`` is reached now: "direct", "hole-punched", "relayed via <relay>", "none"."""
        from swarm.net.relay import path_to

        if self.relay is not None:
            with contextlib.suppress(Exception):
                return str(self.relay.path_label(peer))
        try:
            return str(path_to(self._h, peer).value)
        except Exception:
            return "none"

    def is_admitted(self, peer: str) -> bool:
        return peer in self._admitted

    def admitted_role(self, peer: str) -> str | None:
        """The credential ``peer`` proved: "member" (the swarm secret), "client" (the client
        credential: generations and status only), or None when it is not admitted."""
        ev = self._admitted.get(peer)
        return ev.role if ev is not None else None

    def admitted_peers(self) -> list[str]:
        return sorted(self._admitted)

    def admission_info(self, peer: str) -> HostEvent | None:
        """The "admitted" event of a peer (address, direction, role), or None if not admitted."""
        return self._admitted.get(peer)

    def has_other_connection(self, peer: str, stream: FramedStream) -> bool:
        """Whether ``peer`` has an open connection other than the one ``stream`` runs on (after
        DCUtR, a relayed and a direct one coexist until the relayed one is closed)."""
        mine = getattr(stream.raw, "muxed_conn", None)
        try:
            conns = self._h.get_network().get_connections(ID.from_base58(peer))
        except Exception:
            return False
        return any(c.muxed_conn is not mine and not c.is_closed for c in conns)

    def connected_peers(self) -> list[str]:
        return sorted(str(p) for p in self._h.get_connected_peers())

    def subscribe(self, max_buffer: int = 256) -> trio.MemoryReceiveChannel[HostEvent]:
        """A channel of every later :class:`HostEvent`; events are dropped if it is not drained."""
        send, recv = trio.open_memory_channel[HostEvent](max_buffer)
        self._subscribers.append(send)
        return recv

    def _emit(self, event: HostEvent) -> None:
        for ch in list(self._subscribers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                log.warning("event subscriber is not draining; dropped %s for %s", event.kind, event.peer)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(ch)

    # -- dialing and admission ---------------------------------------------------------------

    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        """Connect to ``addr`` (a multiaddr ending in ``/p2p/<peer id>``) and run admission.

        Returns the peer ID once both sides are admitted. Raises UsageError for a bad address,
        PeerTimeout / PeerError when the peer cannot be reached, AdmissionError when it cannot
        prove the swarm secret (it is then disconnected).
        """
        ma = parse_multiaddr(addr, "dial address")
        try:
            info = info_from_p2p_addr(ma)
        except Exception:
            raise UsageError(f"dial address {addr!r} has no /p2p/<peer id> part") from None
        peer = str(info.peer_id)
        if peer == self.peer_id:
            raise UsageError(f"dial address {addr!r} is this node itself")
        if peer in self.revoked:
            raise AdmissionError(f"peer {peer} is revoked by the swarm's invite: not dialing it")
        if self._banned.get(peer, 0.0) > trio.current_time():
            raise AdmissionError(f"peer {peer} broke the wire protocol recently: not dialing it")
        limit = self.dial_timeout if timeout is None else timeout
        # our callers retry on purpose, with their own backoff: never wait out libp2p's 60 s
        libp2p_patches.forget_dial_failure(self._h, peer)
        # It also dials only the first known TCP address of a peer: forget stale ones (a
        # restarted peer listens elsewhere) unless we are connected already.
        if peer not in self.connected_peers():
            with contextlib.suppress(Exception):
                self._h.get_peerstore().clear_addrs(info.peer_id)
        circuit = "/p2p-circuit" in addr and peer not in self.connected_peers()
        if circuit and self.relay is None:
            raise PeerError(f"cannot dial {addr}: relay circuits are off on this node (join --relay)")
        self._dialing.add(peer)
        try:
            with trio.fail_after(limit):
                if circuit:
                    # py-libp2p's Swarm.dial_peer drops every /p2p-circuit address ("this node
                    # has no relay transport": "All addresses ... are unusable (relay-only or
                    # blocked by connection gate)") even when a CircuitV2Transport runs beside
                    # it; the relay's transport dials it and registers the connection instead.
                    await self.relay.dial_circuit(addr)
                else:
                    await self._h.connect(info)
            await self._admit_outbound(peer, strip_p2p(addr))
        except BaseException as exc:
            if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                raise map_exception(exc, peer, f"dialing {addr}") from None
            raise
        finally:
            self._dialing.discard(peer)
        return peer

    async def _admit_outbound(self, peer: str, addr: str) -> None:
        if peer in self.revoked:
            await self._refuse(peer, addr, "revoked by the swarm's invite")
            raise AdmissionError(f"peer {peer} is revoked by the swarm's invite")
        if peer in self._admitted:
            return
        if peer in self._admitting:  # the other side is admitting us right now: wait for it
            with trio.move_on_after(self.admit_timeout):
                while peer not in self._admitted:
                    await self._admitted_changed.wait()
            if peer in self._admitted:
                return
        self._admitting.add(peer)
        try:
            raw = await self._new_raw_stream(peer, PROTO_ADMIT, self.admit_timeout)
            try:
                side = Initiator(
                    secret=self._secret, swarm_id=self.swarm_id, local_peer=self.peer_id, remote_peer=peer,
                    role=self.role, member_key=self._member_key,
                )  # fmt: skip
                with trio.fail_after(self.admit_timeout):
                    await _pump_handshake(raw, peer, side, side.start())
            finally:
                await _close_raw(raw)
            self._mark_admitted(peer, addr, outbound=True, role=side.peer_role or MEMBER)
        except trio.TooSlowError:
            reason = f"admission handshake did not finish within {self.admit_timeout:g} s"
            await self._refuse(peer, addr, reason)
            raise AdmissionError(f"peer {peer}: {reason}") from None
        except SwarmError as exc:
            await self._refuse(peer, addr, str(exc))
            if isinstance(exc, AdmissionError):
                raise
            raise AdmissionError(f"peer {peer}: admission failed: {exc}") from None
        finally:
            self._admitting.discard(peer)

    async def _serve_admit(self, raw: INetStream) -> None:
        peer = _peer_of(raw)
        addr = conn_addr(raw.muxed_conn)
        if self._banned.get(peer, 0.0) > trio.current_time():
            await _close_raw(raw)
            await self._refuse(peer, addr, "refused for a while after breaking the wire protocol")
            return
        self._admitting.add(peer)
        try:
            side = Responder(
                secret=self._secret, swarm_id=self.swarm_id, local_peer=self.peer_id,
                remote_peer=peer, revoked=self.revoked, role=self.role, member_key=self._member_key,
            )  # fmt: skip

            def admitted() -> None:
                self._mark_admitted(peer, addr, outbound=False, role=side.peer_role or MEMBER)

            with trio.fail_after(self.admit_timeout):
                await _pump_handshake(raw, peer, side, b"", on_admitted=admitted)
        except trio.TooSlowError:
            await self._refuse(peer, addr, f"admission handshake did not finish within {self.admit_timeout:g} s")
        except SwarmError as exc:
            await self._refuse(peer, addr, str(exc))
        except Exception as exc:  # never let a handler error escape into libp2p
            await self._refuse(peer, addr, f"{type(exc).__name__}: {exc}")
        finally:
            self._admitting.discard(peer)
            await _close_raw(raw)

    def _mark_admitted(self, peer: str, addr: str, *, outbound: bool, role: str) -> None:
        if peer in self._admitted:
            return
        ev = HostEvent("admitted", peer, addr, "", outbound, role)
        self._admitted[peer] = ev
        self._pending.pop(peer, None)
        pid = ID.from_base58(peer)
        for muxed in libp2p_patches.muxed_conns(self._h, pid):
            muxed.pending_admission = False
        self._admitted_changed.set()
        self._admitted_changed = trio.Event()
        log.info("admitted peer %s (%s, %s%s)", peer, addr or "?", "outbound" if outbound else "inbound",
                 "" if role == MEMBER else f", {role}")  # fmt: skip
        libp2p_patches.identify_now(self._h, pid)
        self._emit(ev)

    async def _refuse(self, peer: str, addr: str, reason: str) -> None:
        # Never log the secret: reasons come from swarm.proto.admission, which names fields, not values.
        log.warning("refused peer %s (%s): %s", peer, addr or "?", reason)
        self._admitted.pop(peer, None)
        self._pending.pop(peer, None)
        self._emit(HostEvent("refused", peer, addr, reason))
        await self.disconnect(peer)

    def _on_connected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        if self._closed:
            return
        if peer in self._admitted:
            conn.muxed_conn.pending_admission = False
            return
        conn.muxed_conn.pending_admission = True
        if peer not in self._dialing:
            self._pending.setdefault(peer, trio.current_time())
            if len(self._pending) > MAX_PENDING_ADMISSIONS:
                oldest = min(self._pending, key=self._pending.__getitem__)
                del self._pending[oldest]
                reason = f"{MAX_PENDING_ADMISSIONS} connections were waiting for admission; this one the longest"
                with contextlib.suppress(RuntimeError):
                    self._nursery.start_soon(self._refuse, oldest, "", reason)
        with contextlib.suppress(RuntimeError):
            self._nursery.start_soon(self._admission_watchdog, peer, conn_addr(conn))

    def _on_disconnected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        with contextlib.suppress(Exception):
            if self._h.get_network().connections.get(conn.muxed_conn.peer_id):
                return  # another connection to the same peer is still up
        self._pending.pop(peer, None)
        ev = self._admitted.pop(peer, None)
        if ev is not None:
            log.info("peer %s disconnected", peer)
            self._emit(HostEvent("disconnected", peer, ev.addr, "connection closed", ev.outbound, ev.role))

    async def _admission_watchdog(self, peer: str, addr: str) -> None:
        """An inbound (or outbound) connection that is not admitted in time is dropped."""
        with trio.move_on_after(self.admit_timeout + 1.0):
            while peer not in self._admitted:
                await self._admitted_changed.wait()
            return
        if peer not in self._admitted and peer in self.connected_peers():
            await self._refuse(peer, addr, f"did not complete admission within {self.admit_timeout:g} s")

    async def _wait_admitted(self, peer: str) -> bool:
        with trio.move_on_after(self.admit_timeout):
            while peer not in self._admitted:
                await self._admitted_changed.wait()
        return peer in self._admitted

    # -- streams -----------------------------------------------------------------------------

    async def _gate(self, protocol: str, raw: INetStream, handler: Callable[[INetStream], Awaitable[None]]) -> None:
        """Every libp2p stream handler but admission's runs through here (libp2p_patches.govern_host):
        a stream from a peer not yet admitted waits for its admission (bounded) or is reset; a
        client gets only what is open to clients."""
        peer = _peer_of(raw)
        if peer not in self._admitted and not await self._wait_admitted(peer):
            log.info("reset a %s stream from %s: it was not admitted within %g s", protocol, peer, self.admit_timeout)
            await _reset(raw)
            return
        if self.admitted_role(peer) != MEMBER and protocol not in self._client_protocols:
            log.warning("refused %s stream from %s: a client may not use it", protocol, peer)
            await _reset(raw)
            return
        await handler(raw)

    def claim_stream(self, peer: str) -> Callable[[], None] | None:
        """Take one of ``peer``'s MAX_STREAMS_PER_PEER inbound stream slots (for a stream served
        outside :meth:`handle`, e.g. a fast-path channel): a function that gives it back (call
        it once), or None when the peer holds them all."""
        if self._streams.get(peer, 0) >= MAX_STREAMS_PER_PEER:
            return None
        self._streams[peer] = self._streams.get(peer, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._streams[peer] -= 1
            if not self._streams[peer]:
                del self._streams[peer]

        return release

    def hold_stream_slot(self, peer: str, owner: Any) -> Callable[[], None] | None:
        """:meth:`claim_stream` for the lifetime of ``owner``: the slot comes back when the
        returned function is called or when ``owner`` is garbage-collected, whichever is first."""
        release = self.claim_stream(peer)
        return None if release is None else weakref.finalize(owner, release)

    def handle(self, protocol: str, handler: Handler, *, roles: Iterable[str] = (MEMBER,)) -> None:
        """Serve ``protocol``: ``handler(peer, stream)`` runs for each inbound stream from a peer
        admitted with one of ``roles`` (default: members only; a generation or status protocol
        adds CLIENT); streams from anyone else are reset and logged. Errors a handler raises are
        logged, never propagated into libp2p."""
        if protocol == PROTO_ADMIT:
            raise UsageError(f"{PROTO_ADMIT} is served by the host itself")
        allowed = frozenset(roles)
        if not allowed or not allowed <= set(ROLES):
            raise UsageError(f"roles for {protocol} must be among {', '.join(ROLES)}, got {sorted(allowed)}")
        if CLIENT in allowed:
            self._client_protocols.add(protocol)
        else:
            self._client_protocols.discard(protocol)

        async def wrapped(raw: INetStream) -> None:
            peer = _peer_of(raw)
            role = self.admitted_role(peer)
            if role not in allowed:
                log.warning("refused %s stream from %s peer %s", protocol, role or "unadmitted", peer)
                await _reset(raw)
                return
            release = self.claim_stream(peer)
            if release is None:
                log.warning("refused %s stream from %s: %d open (limit)", protocol, peer, MAX_STREAMS_PER_PEER)
                await _reset(raw)
                return
            try:
                async with open_framed(
                    raw, peer=peer, protocol=protocol, limits=self.limits, io_timeout=self.io_timeout
                ) as fs:
                    await handler(peer, fs)
            except PeerError as exc:
                log.debug("%s stream from %s ended: %s", protocol, peer, exc)
            except FrameError as exc:
                # bytes no honest peer sends (oversized, truncated, malformed frames): drop the
                # peer and refuse it for a while; the other connections never notice
                self._banned[peer] = trio.current_time() + BAN_S
                await self._refuse(peer, "", f"broke the wire protocol on {protocol}: {exc}; refused for {BAN_S:.0f} s")
            except SwarmError as exc:
                log.warning("%s stream from %s failed: %s", protocol, peer, exc)
            except Exception as exc:
                if is_foreign_io_error(exc):
                    log.debug("%s stream from %s ended: %s", protocol, peer, map_exception(exc, peer, "serving"))
                else:
                    log.exception("handler for %s crashed on a stream from %s", protocol, peer)
            finally:
                release()

        self._h.set_stream_handler(TProtocol(protocol), wrapped)

    @contextlib.asynccontextmanager
    async def open_stream(
        self, peer: str, protocol: str, *, timeout: float | None = None
    ) -> AsyncIterator[FramedStream]:
        """A framed stream to an admitted peer (AdmissionError for any other)."""
        if peer not in self._admitted:
            raise AdmissionError(f"peer {peer} is not admitted: refusing to open {protocol}")
        async with self._open_raw(peer, protocol, self.io_timeout if timeout is None else timeout) as fs:
            yield fs

    @contextlib.asynccontextmanager
    async def _open_raw(self, peer: str, protocol: str, timeout: float) -> AsyncIterator[FramedStream]:
        raw = await self._new_raw_stream(peer, protocol, timeout)
        async with open_framed(raw, peer=peer, protocol=protocol, limits=self.limits, io_timeout=timeout) as fs:
            yield fs

    async def _new_raw_stream(self, peer: str, protocol: str, timeout: float) -> INetStream:
        try:
            with trio.fail_after(timeout):
                return await self._h.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
        except BaseException as exc:
            if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                raise map_exception(exc, peer, f"opening {protocol}") from None
            raise

    async def libp2p_ping(self, peer: str, *, timeout: float = 2.0) -> float:
        """Round-trip time in seconds of one libp2p ping (/ipfs/ping/1.0.0) to ``peer``."""
        payload = bytes(range(PING_LENGTH))
        try:
            with trio.fail_after(timeout):
                raw = await self._h.new_stream(ID.from_base58(peer), [TProtocol(str(PING_PROTOCOL))])
                try:
                    t0 = trio.current_time()
                    await raw.write(payload)
                    got = b""
                    while len(got) < PING_LENGTH:
                        chunk = await raw.read(PING_LENGTH - len(got))
                        if not chunk:
                            raise EOFError("ping stream closed")
                        got += chunk
                    rtt = trio.current_time() - t0
                finally:
                    await _close_raw(raw)
        except BaseException as exc:
            if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                raise map_exception(exc, peer, "pinging") from None
            raise
        if got != payload:
            raise PeerError(f"peer {peer}: ping echoed different bytes")
        return rtt

    async def disconnect(self, peer: str) -> None:
        """Close every connection to ``peer`` (bounded, never raises)."""
        self._admitted.pop(peer, None)
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT), contextlib.suppress(Exception):
            await self._h.disconnect(ID.from_base58(peer))


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


async def _close_raw(raw: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
        await raw.close()


def build_libp2p_host(seed: bytes, listen: Sequence[multiaddr.Multiaddr]) -> Any:
    """A py-libp2p host with Noise-only security and yamux-only muxing (see module docstring),
    after the pinned-version check and the process-wide adaptations (libp2p_patches.apply)."""
    libp2p_patches.apply()
    if not isinstance(seed, bytes | bytearray) or len(seed) != 32:
        raise UsageError("identity seed must be 32 bytes (an Ed25519 seed)")
    key_pair = create_new_key_pair(bytes(seed))
    sec_opt = {
        TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
            key_pair, noise_privkey=create_x25519_key_pair().private_key
        )
    }
    muxer_opt = {TProtocol(YAMUX_PROTOCOL_ID): WholeFrameYamux}
    config = ConnectionConfig(
        max_connections_per_peer=1,  # connect() waits 250 ms otherwise
        min_connections=0,  # never auto-redial peers we dropped
        low_watermark=0,
        dial_timeout=DEFAULT_DIAL_TIMEOUT,
    )
    return new_host(
        key_pair=key_pair,
        sec_opt=sec_opt,  # type: ignore[arg-type]
        muxer_opt=muxer_opt,  # type: ignore[arg-type]
        listen_addrs=list(listen),
        connection_config=config,
        enable_mDNS=False,
    )


@contextlib.asynccontextmanager
async def open_host(
    seed: bytes,
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    *,
    secret: bytes,
    swarm_id: str,
    revoked: frozenset[str] = frozenset(),
    limits: Limits = DEFAULT_LIMITS,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
    admit_timeout: float = DEFAULT_ADMIT_TIMEOUT,
    role: str = MEMBER,
    member_key: bytes = b"",
) -> AsyncIterator[SwarmHost]:
    """Run a host listening on ``listen`` for the swarm ``swarm_id``.

    ``role`` MEMBER: ``secret`` is the swarm secret. ``role`` CLIENT: ``secret`` is the client
    secret and ``member_key`` the swarm's member key (both from a client invite); such a host
    admits nobody and is admitted by members as a client. ``seed`` is the node's 32-byte
    Ed25519 identity seed. Leaving the block closes every connection and stream and cancels
    every task the host started.
    """
    if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
        raise UsageError("swarm secret must be at least 16 bytes")
    if role not in ROLES:
        raise UsageError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == CLIENT and len(member_key) != 32:
        raise UsageError("a client host needs the swarm's 32-byte member key (from its client invite)")
    for name, v in (("io_timeout", io_timeout), ("dial_timeout", dial_timeout), ("admit_timeout", admit_timeout)):
        if not (v > 0 and math.isfinite(v)):
            raise UsageError(f"{name} must be a positive number of seconds, got {v!r}")
    addrs = [parse_multiaddr(a, "listen address") for a in listen]
    if not addrs:
        raise UsageError("open_host needs at least one listen address")
    h = build_libp2p_host(seed, addrs)
    async with trio.open_nursery() as nursery:
        host = SwarmHost(
            h, nursery, secret=bytes(secret), swarm_id=swarm_id, revoked=revoked, limits=limits, io_timeout=io_timeout,
            dial_timeout=dial_timeout, admit_timeout=admit_timeout, role=role, member_key=bytes(member_key),
        )  # fmt: skip
        h.get_network().register_notifee(_Notifee(host))
        libp2p_patches.govern_host(h, gate=host._gate, open_protocols=frozenset({PROTO_ADMIT}), is_admitted=host.is_admitted)
        h.set_stream_handler(TProtocol(PROTO_ADMIT), host._serve_admit)
        try:
            async with h.run(addrs):
                try:
                    yield host
                finally:
                    host._closed = True
                    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                        await h.close()
                    for ch in host._subscribers:
                        ch.close()
        except OSError as exc:
            raise PeerError(f"cannot listen on {', '.join(listen)}: {exc}") from None
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["HostEvent", "SwarmHost", "build_libp2p_host", "dialable_addrs", "is_wildcard", "open_host"]
