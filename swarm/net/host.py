"""The libp2p host: TCP + Noise + yamux only, admission first, framed streams, clean shutdown.

Theory of operation
-------------------
:func:`open_host` builds a py-libp2p 0.8.1 host from the node's 32-byte Ed25519 seed (the same
seed as ``swarm.manifest.identity``, so the peer ID and the advert signatures share one key), with
an explicit Noise-only security table and a yamux-only muxer table: the library's defaults also
accept plaintext, secio and TLS, which would let a dialer claim another peer's ID.
``ConnectionConfig(max_connections_per_peer=1)`` avoids the fixed 250 ms wait in ``connect()``;
the auto-connector's minimums are zeroed so the library never redials a peer we dropped.

Frame writes are whole (:class:`WholeFrameYamux`). py-libp2p's Noise session encrypts a frame,
spending a nonce, before it writes it; a task cancelled between the two (a reader whose read
sends a window update, a sender whose caller gave up) used to leave the peer a nonce behind or a
frame half-sent, so every later frame failed to decrypt and every stream to that peer died: a
client hanging up on one generation could cut the ring. A frame write, once started, now
finishes; one stuck on a peer that stopped reading is bounded, and closing the connection ends it.

Admission gates everything of the swarm. A connection is only transport-authenticated (Noise
proves the peer ID); before any swarm protocol is served to or requested from a peer, both sides
prove the swarm secret on :data:`PROTO_ADMIT` (the sans-IO handshake of ``swarm.proto.admission``). The dialer runs the handshake
right after connecting; an inbound peer that has not completed it within ``admit_timeout`` is
disconnected. A peer that fails is logged (peer ID and reason, never the secret) and
disconnected; the other connections never notice. Handlers registered with
:meth:`SwarmHost.handle` refuse (reset) streams from peers that are not admitted, and
:meth:`SwarmHost.open_stream` refuses to talk to them.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer import muxer_multistream as _muxer_multistream
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable
from libp2p.stream_muxer.yamux.yamux import GO_AWAY_NORMAL, Yamux
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from swarm.errors import AdmissionError, FrameError, PeerError, SwarmError, UsageError
from swarm.net.streams import (
    DEFAULT_IO_TIMEOUT,
    FramedStream,
    is_foreign_io_error,
    map_exception,
    open_framed,
)
from swarm.proto.admission import Initiator, Responder
from swarm.proto.limits import DEFAULT_LIMITS, PROTO_ADMIT, Limits

log = logging.getLogger("swarm.net.host")

DEFAULT_DIAL_TIMEOUT = 10.0
DEFAULT_ADMIT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 3.0
BAN_S = 300.0
MAX_STREAMS_PER_PEER = 256  # inbound swarm streams one peer may hold open at once  # a peer that sent malformed frames is refused this long

FRAME_WRITE_TIMEOUT_S = 10.0  # one muxer frame's write, once begun; longer: the connection is closed

Handler = Callable[[str, FramedStream], Awaitable[None]]


class WholeFrameYamux(Yamux):
    """yamux whose frame writes a cancellation cannot tear (see the module docstring).

    Waiting for the write lock stays cancellable: nothing has been encrypted yet. The write itself
    is shielded and bounded by FRAME_WRITE_TIMEOUT_S; past that the connection is *torn* (a
    partial frame may be out), closed, and every later write fails at once. ``close()`` while a
    write is stuck closes the socket first, which ends the write, instead of queueing GO_AWAY
    behind it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._torn = ""
        self._writing = False

    async def _write_frame(self, data: bytes) -> None:
        if self._torn:
            raise MuxedConnUnavailable(self._torn)
        async with self._write_lock:
            if self._torn:
                raise MuxedConnUnavailable(self._torn)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FRAME_WRITE_TIMEOUT_S) as stuck:
                    self._writing = True
                    try:
                        await self.secured_conn.write(data)
                    except BaseException:
                        self._torn = "a frame write failed"
                        raise
                    finally:
                        self._writing = False
                if stuck.cancelled_caught:
                    self._torn = f"a frame write took over {FRAME_WRITE_TIMEOUT_S:g} s"
                    with trio.move_on_after(CLOSE_TIMEOUT), contextlib.suppress(Exception):
                        await self.secured_conn.close()
            if self._torn:
                raise MuxedConnUnavailable(self._torn)
        await trio.lowlevel.checkpoint()

    async def close(self, error_code: int = GO_AWAY_NORMAL) -> None:
        if self._writing:
            self._torn = self._torn or "closed during a write"
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT), contextlib.suppress(Exception):
                await self.secured_conn.close()
        await super().close(error_code)


# py-libp2p 0.8.1 builds a yamux connection with the class its muxer_multistream module names,
# whatever class the muxer options give: point that name at ours (this module's import does it,
# and every host of the process is built through here).
_muxer_multistream.Yamux = WholeFrameYamux  # type: ignore[misc]


@dataclass(frozen=True)
class HostEvent:
    """Something happened to a peer. ``kind``: "admitted", "refused" or "disconnected"."""

    kind: str
    peer: str
    addr: str = ""  # remote address of the connection ("/ip4/.../tcp/..."), when known
    reason: str = ""
    outbound: bool = False  # we dialed it


def _parse_multiaddr(text: str, what: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types
        raise UsageError(f"{what}: {text!r} is not a valid multiaddr ({exc})") from None


def _peer_of(raw: Any) -> str:
    return str(raw.muxed_conn.peer_id)


def _conn_addr(conn: Any) -> str:
    """Remote transport address of a connection, best effort ("" when unknown)."""
    with contextlib.suppress(Exception):
        addrs = conn.get_transport_addresses()
        if addrs:
            return str(addrs[0])
    with contextlib.suppress(Exception):
        ip, port = conn.muxed_conn.secured_conn.get_remote_address()
        return f"/ip4/{ip}/tcp/{port}"
    return ""


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
    ) -> None:
        self._h = libp2p_host
        self._nursery = nursery
        self._secret = secret
        self.swarm_id = swarm_id
        self.revoked = revoked
        self._banned: dict[str, float] = {}
        self._streams: dict[str, int] = {}  # peer -> inbound swarm streams open now  # peer -> trio time until which it is refused
        self.limits = limits
        self.io_timeout = io_timeout
        self.dial_timeout = dial_timeout
        self.admit_timeout = admit_timeout
        self.peer_id: str = str(libp2p_host.get_id())
        self._admitted: dict[str, HostEvent] = {}
        self._admitting: set[str] = set()
        self._admitted_changed = trio.Event()
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

    def admitted_peers(self) -> list[str]:
        return sorted(self._admitted)

    def admission_info(self, peer: str) -> HostEvent | None:
        """The "admitted" event of a peer (address, direction), or None if not admitted."""
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
        ma = _parse_multiaddr(addr, "dial address")
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
        # py-libp2p refuses every dial to a peer for 60 s after one failed ("negative cache"),
        # even to a new address; our callers retry on purpose, with their own backoff.
        cache = getattr(self._h.get_network(), "_negative_peer_cache", None)
        with contextlib.suppress(Exception):
            cache.evict(peer)  # type: ignore[union-attr]
        # It also dials only the first known TCP address of a peer: forget stale ones (a
        # restarted peer listens elsewhere) unless we are connected already.
        if peer not in self.connected_peers():
            with contextlib.suppress(Exception):
                self._h.get_peerstore().clear_addrs(info.peer_id)
        circuit = "/p2p-circuit" in addr and peer not in self.connected_peers()
        if circuit and self.relay is None:
            raise PeerError(f"cannot dial {addr}: relay circuits are off on this node (join --relay)")
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
        except BaseException as exc:
            if is_foreign_io_error(exc) or isinstance(exc, trio.TooSlowError):
                raise map_exception(exc, peer, f"dialing {addr}") from None
            raise
        await self._admit_outbound(peer, _strip_p2p(addr))
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
                    secret=self._secret, swarm_id=self.swarm_id, local_peer=self.peer_id, remote_peer=peer
                )
                with trio.fail_after(self.admit_timeout):
                    await _pump_handshake(raw, peer, side, side.start())
            finally:
                await _close_raw(raw)
            self._mark_admitted(peer, addr, outbound=True)
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
        addr = _conn_addr(raw.muxed_conn)
        if self._banned.get(peer, 0.0) > trio.current_time():
            await _close_raw(raw)
            await self._refuse(peer, addr, "refused for a while after breaking the wire protocol")
            return
        self._admitting.add(peer)
        try:
            side = Responder(
                secret=self._secret, swarm_id=self.swarm_id, local_peer=self.peer_id,
                remote_peer=peer, revoked=self.revoked,
            )  # fmt: skip
            with trio.fail_after(self.admit_timeout):
                await _pump_handshake(
                    raw, peer, side, b"", on_admitted=lambda: self._mark_admitted(peer, addr, outbound=False)
                )
        except trio.TooSlowError:
            await self._refuse(peer, addr, f"admission handshake did not finish within {self.admit_timeout:g} s")
        except SwarmError as exc:
            await self._refuse(peer, addr, str(exc))
        except Exception as exc:  # never let a handler error escape into libp2p
            await self._refuse(peer, addr, f"{type(exc).__name__}: {exc}")
        finally:
            self._admitting.discard(peer)
            await _close_raw(raw)

    def _mark_admitted(self, peer: str, addr: str, *, outbound: bool) -> None:
        if peer in self._admitted:
            return
        ev = HostEvent("admitted", peer, addr, "", outbound)
        self._admitted[peer] = ev
        self._admitted_changed.set()
        self._admitted_changed = trio.Event()
        log.info("admitted peer %s (%s, %s)", peer, addr or "?", "outbound" if outbound else "inbound")
        self._emit(ev)

    async def _refuse(self, peer: str, addr: str, reason: str) -> None:
        # Never log the secret: reasons come from swarm.proto.admission, which names fields, not values.
        log.warning("refused peer %s (%s): %s", peer, addr or "?", reason)
        self._admitted.pop(peer, None)
        self._emit(HostEvent("refused", peer, addr, reason))
        await self.disconnect(peer)

    def _on_connected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                self._nursery.start_soon(self._admission_watchdog, peer, _conn_addr(conn))

    def _on_disconnected(self, conn: Any) -> None:
        peer = str(conn.muxed_conn.peer_id)
        with contextlib.suppress(Exception):
            if self._h.get_network().connections.get(conn.muxed_conn.peer_id):
                return  # another connection to the same peer is still up
        ev = self._admitted.pop(peer, None)
        if ev is not None:
            log.info("peer %s disconnected", peer)
            self._emit(HostEvent("disconnected", peer, ev.addr, "connection closed", ev.outbound))

    async def _admission_watchdog(self, peer: str, addr: str) -> None:
        """An inbound (or outbound) connection that is not admitted in time is dropped."""
        with trio.move_on_after(self.admit_timeout + 1.0):
            while peer not in self._admitted:
                await self._admitted_changed.wait()
            return
        if peer not in self._admitted and peer in self.connected_peers():
            await self._refuse(peer, addr, f"did not complete admission within {self.admit_timeout:g} s")

    # -- streams -----------------------------------------------------------------------------

    def handle(self, protocol: str, handler: Handler) -> None:
        """Serve ``protocol``: ``handler(peer, stream)`` runs for each inbound stream from an
        admitted peer; streams from anyone else are reset and logged. Errors a handler raises
        are logged, never propagated into libp2p."""
        if protocol == PROTO_ADMIT:
            raise UsageError(f"{PROTO_ADMIT} is served by the host itself")

        async def wrapped(raw: INetStream) -> None:
            peer = _peer_of(raw)
            if peer not in self._admitted:
                log.warning("refused %s stream from unadmitted peer %s", protocol, peer)
                with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
                    await raw.reset()
                return
            if self._streams.get(peer, 0) >= MAX_STREAMS_PER_PEER:
                log.warning("refused %s stream from %s: %d open (limit)", protocol, peer, MAX_STREAMS_PER_PEER)
                with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
                    await raw.reset()
                return
            self._streams[peer] = self._streams.get(peer, 0) + 1
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
                self._streams[peer] -= 1
                if not self._streams[peer]:
                    del self._streams[peer]

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
                    with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
                        await raw.close()
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


def is_wildcard(addr: str) -> bool:
    """A listen-everywhere address (0.0.0.0, ::): no peer can dial it."""
    return addr.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


def dialable_addrs(addrs: Sequence[str], table: dict[str, list[str]]) -> list[str]:
    """``addrs`` as other machines can dial them: a wildcard IPv4 listen address becomes one
    address per IPv4 interface address in ``table`` (interface -> IPs); loopback only when the
    machine has nothing else (a peer elsewhere dialing 127.0.0.1 reaches itself). IPv6
    wildcards are dropped (no IPv6 routing is assumed). Order kept, duplicates removed."""
    ips = [ip for v in table.values() for ip in v if ":" not in ip]
    public = [ip for ip in ips if not ip.startswith("127.")]
    use = public or [ip for ip in ips if ip.startswith("127.")] or ["127.0.0.1"]
    out: list[str] = []
    for a in addrs:
        if a.startswith("/ip4/0.0.0.0/"):
            out += [a.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in use]
        elif not is_wildcard(a):
            out.append(a)
    return list(dict.fromkeys(out))


def _strip_p2p(addr: str) -> str:
    i = addr.find("/p2p/")
    return addr[:i] if i >= 0 else addr


def build_libp2p_host(seed: bytes, listen: Sequence[multiaddr.Multiaddr]) -> Any:
    """A py-libp2p host with Noise-only security and yamux-only muxing (see module docstring)."""
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
) -> AsyncIterator[SwarmHost]:
    """Run a host listening on ``listen`` for the swarm ``swarm_id`` whose secret is ``secret``.

    ``seed`` is the node's 32-byte Ed25519 identity seed. Leaving the block closes every
    connection and stream and cancels every task the host started.
    """
    if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
        raise UsageError("swarm secret must be at least 16 bytes")
    for name, v in (("io_timeout", io_timeout), ("dial_timeout", dial_timeout), ("admit_timeout", admit_timeout)):
        if not (v > 0 and math.isfinite(v)):
            raise UsageError(f"{name} must be a positive number of seconds, got {v!r}")
    addrs = [_parse_multiaddr(a, "listen address") for a in listen]
    if not addrs:
        raise UsageError("open_host needs at least one listen address")
    h = build_libp2p_host(seed, addrs)
    async with trio.open_nursery() as nursery:
        host = SwarmHost(
            h, nursery, secret=bytes(secret), swarm_id=swarm_id, revoked=revoked, limits=limits, io_timeout=io_timeout,
            dial_timeout=dial_timeout, admit_timeout=admit_timeout,
        )  # fmt: skip
        h.get_network().register_notifee(_Notifee(host))
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
