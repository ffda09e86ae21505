"""The libp2p host: TCP + Noise + yamux only, admission first, framed streams, clean shutdown.

Theory of operation
-------------------
:func:`open_host` runs a py-libp2p 0.8.1 host built by ``libp2p_host.build_libp2p_host`` from the
node's 32-byte Ed25519 seed (the same seed as ``swarm.manifest.identity``, so the peer ID and the
advert signatures share one key): Noise-only security, yamux-only muxing, after the
pinned-version check and py-libp2p's adaptations (``libp2p_patches.py``).

Admission gates everything. A connection is only transport-authenticated (Noise proves the peer
ID); before anything is served to or requested from a peer, both sides prove a credential on
:data:`PROTO_ADMIT` (the sans-IO handshake of ``swarm.proto.admission``): the swarm secret (a
*member*) or the client credential derived from it (a *client*, which may only run generations
and read status). The dialer runs the handshake right after connecting; an inbound peer that has
not completed it within ``admit_timeout`` is disconnected. A peer that fails is logged (peer ID
and reason, never the secret) and disconnected; the other connections never notice.

What an unadmitted peer can make the host do, roles, and the gate in front of every handler:
``door.py`` (:class:`~swarm.net.door.Door`, ``host.door``).

Lifetime: everything runs inside the ``async with open_host(...)`` block's nursery. Leaving it
calls ``host.close()`` *before* leaving ``host.run()`` (py-libp2p leaks connections otherwise),
all under a shielded, bounded cancel scope.

Events (admitted, refused, disconnected) are delivered to every subscriber's memory channel; node/
uses them to drive membership and heartbeats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import PING_LENGTH
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from swarm.errors import AdmissionError, FrameError, PeerError, SwarmError, UsageError
from swarm.net import libp2p_patches
from swarm.net.addrs import dialable_addrs, is_wildcard, parse_multiaddr, strip_p2p
from swarm.net.door import Credential, Door, HostEvent, close_raw, peer_of, reset_raw
from swarm.net.libp2p_host import DEFAULT_DIAL_TIMEOUT, ConnectionNotifee, build_libp2p_host
from swarm.net.streams import (
    DEFAULT_IO_TIMEOUT,
    DEFAULT_MAX_QUEUED,
    FramedStream,
    is_foreign_io_error,
    map_exception,
    open_framed,
)
from swarm.proto.admission import CLIENT, MEMBER, ROLES
from swarm.proto.limits import DEFAULT_LIMITS, PROTO_ADMIT, Limits

log = logging.getLogger("swarm.net.host")

DEFAULT_ADMIT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 3.0
BAN_S = 300.0  # a peer that sent malformed frames is refused this long
MAX_STREAMS_PER_PEER = 256  # inbound swarm streams (fast-path channels included) one peer may hold open at once
# a client's frames on the protocols open to it: a prompt, a status request; not a 32 MiB tensor.
# 384 KiB holds every valid one (at most 64 Ki token ids, 256 KiB, plus 64 KiB of metadata; issue
# 26 sends ids in chunks of at most 64 KiB a frame). A few queued at most.
CLIENT_FRAME_BYTES = 384 * 1024
CLIENT_QUEUED = 4

Handler = Callable[[str, FramedStream], Awaitable[None]]


class SwarmHost:
    """A running libp2p host that speaks only to admitted peers. Build with :func:`open_host`."""

    def __init__(
        self,
        libp2p_host: Any,
        nursery: trio.Nursery,
        *,
        credential: Credential,
        swarm_id: str,
        revoked: frozenset[str],
        limits: Limits,
        io_timeout: float,
        dial_timeout: float,
        admit_timeout: float,
    ) -> None:
        self._h = libp2p_host
        self.peer_id: str = str(libp2p_host.get_id())
        self.role = credential.role  # what this host proves: MEMBER (the swarm secret) or CLIENT
        self.swarm_id = swarm_id
        self.revoked = revoked
        self.limits = limits
        self.client_limits = dataclasses.replace(limits, max_frame_bytes=min(limits.max_frame_bytes, CLIENT_FRAME_BYTES))
        self.io_timeout = io_timeout
        self.dial_timeout = dial_timeout
        self.admit_timeout = admit_timeout
        self._subscribers: list[trio.MemorySendChannel[HostEvent]] = []
        self.door = Door(
            libp2p_host, nursery, credential=credential, swarm_id=swarm_id, local_peer=self.peer_id,
            revoked=revoked, admit_timeout=admit_timeout, emit=self._emit,
        )  # fmt: skip
        self._streams: dict[str, int] = {}  # peer -> inbound swarm streams (and fast channels) open now
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
        from swarm.net.paths import path_to

        if self.relay is not None:
            with contextlib.suppress(Exception):
                return str(self.relay.path_label(peer))
        try:
            return str(path_to(self._h, peer).value)
        except Exception:
            return "none"

    def is_admitted(self, peer: str) -> bool:
        return peer in self.door.admitted

    def admitted_role(self, peer: str) -> str | None:
        """The credential ``peer`` proved: "member" (the swarm secret), "client" (the client
        credential: generations and status only), or None when it is not admitted."""
        return self.door.role_of(peer)

    def admitted_peers(self) -> list[str]:
        return sorted(self.door.admitted)

    def admission_info(self, peer: str) -> HostEvent | None:
        """The "admitted" event of a peer (address, direction, role), or None if not admitted."""
        return self.door.admitted.get(peer)

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

    # -- dialing -----------------------------------------------------------------------------

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
        if self.door.is_banned(peer):
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
        with self.door.dialing(peer):
            try:
                with trio.fail_after(limit):
                    if circuit:
                        # py-libp2p's Swarm.dial_peer drops every /p2p-circuit address even when
                        # a CircuitV2Transport runs beside it; the relay's transport dials it and
                        # registers the connection instead.
                        await self.relay.dial_circuit(addr)
                    else:
                        await self._h.connect(info)
            except BaseException as exc:
                if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                    raise map_exception(exc, peer, f"dialing {addr}") from None
                raise
            await self.door.admit_outbound(
                peer, strip_p2p(addr), lambda: self._new_raw_stream(peer, PROTO_ADMIT, self.admit_timeout)
            )
        return peer

    # -- streams -----------------------------------------------------------------------------

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
            self.door.client_protocols.add(protocol)
        else:
            self.door.client_protocols.discard(protocol)

        async def wrapped(raw: INetStream) -> None:
            peer = peer_of(raw)
            role = self.admitted_role(peer)
            if role not in allowed:
                log.warning("refused %s stream from %s peer %s", protocol, role or "unadmitted", peer)
                await reset_raw(raw)
                return
            release = self.claim_stream(peer)
            if release is None:
                log.warning("refused %s stream from %s: %d open (limit)", protocol, peer, MAX_STREAMS_PER_PEER)
                await reset_raw(raw)
                return
            try:
                client = role != MEMBER  # a client sends prompts: small frames, few queued
                async with open_framed(
                    raw, peer=peer, protocol=protocol, limits=self.client_limits if client else self.limits,
                    io_timeout=self.io_timeout, max_queued=CLIENT_QUEUED if client else DEFAULT_MAX_QUEUED,
                ) as fs:
                    await handler(peer, fs)
            except PeerError as exc:
                log.debug("%s stream from %s ended: %s", protocol, peer, exc)
            except FrameError as exc:
                # bytes no honest peer sends (oversized, truncated, malformed frames): drop the
                # peer and refuse it for a while; the other connections never notice
                self.door.banned[peer] = trio.current_time() + BAN_S
                await self.door.refuse(peer, "", f"broke the wire protocol on {protocol}: {exc}; refused for {BAN_S:.0f} s")
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
        if peer not in self.door.admitted:
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
                    await close_raw(raw)
        except BaseException as exc:
            if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                raise map_exception(exc, peer, "pinging") from None
            raise
        if got != payload:
            raise PeerError(f"peer {peer}: ping echoed different bytes")
        return rtt

    async def disconnect(self, peer: str) -> None:
        """Close every connection to ``peer`` (bounded, never raises)."""
        await self.door.disconnect(peer)


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
    credential = Credential(bytes(secret), role, bytes(member_key))
    async with trio.open_nursery() as nursery:
        host = SwarmHost(
            h, nursery, credential=credential, swarm_id=swarm_id, revoked=revoked, limits=limits,
            io_timeout=io_timeout, dial_timeout=dial_timeout, admit_timeout=admit_timeout,
        )  # fmt: skip
        h.get_network().register_notifee(ConnectionNotifee(host.door.on_connected, host.door.on_disconnected))
        host.door.govern()
        try:
            async with h.run(addrs):
                try:
                    yield host
                finally:
                    host.door.closed = True
                    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                        await h.close()
                    for ch in host._subscribers:
                        ch.close()
        except OSError as exc:
            raise PeerError(f"cannot listen on {', '.join(listen)}: {exc}") from None
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["Credential", "HostEvent", "SwarmHost", "dialable_addrs", "is_wildcard", "open_host"]
