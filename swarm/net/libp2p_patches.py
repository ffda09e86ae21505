"""Every adaptation of py-libp2p 0.8.1 in one place, applied explicitly, for that version only.

Theory of operation
-------------------
py-libp2p gives no hooks for what a node exposed to outsiders needs, so a few of its internals
are adapted here and nowhere else. :func:`apply` installs the process-wide ones; ``open_host``
calls it before it builds a host (calling it again is a no-op). Each adaptation says which
measurement or bug made it necessary. :func:`apply` first checks the installed version and
refuses any other than :data:`PINNED_VERSION`: these touch private names whose meaning a
release may change, and a silent mismatch would turn a guard into a no-op.

Process-wide (class swaps; py-libp2p builds these objects from module-level names):

- :class:`WholeFrameYamux` replaces ``Yamux`` (``muxer_multistream`` builds yamux from the class
  its module names, whatever the muxer options say). Frame writes, once begun, finish or tear
  the connection: a cancelled write used to leave Noise a nonce behind and kill every stream.
  It also caps the streams an unadmitted peer may open (:data:`PRE_ADMISSION_STREAMS`, on
  connections a SwarmHost governs), and refuses a DATA frame no open window allows.
- :class:`GuardedYamuxStream` replaces ``YamuxStream``: a peer that sends past a stream's
  receive window is a protocol violation that closes the connection. py-libp2p only logs a
  warning and buffers it; an outsider pushed 768 MiB into one identify stream in 3 s (RSS 93 ->
  869 MiB) before the admission watchdog dropped it.

Per host (:func:`govern_host`): every stream handler, present and future, goes through a gate
(``SwarmHost`` decides: serve, wait for admission, or reset); outbound identify runs only
towards admitted peers (and :func:`identify_now` starts it on admission); small helpers read or
clear the private state the node needs (the negative dial cache, DCUtR's attempt budget, a
connection's local socket) so no other module names a private py-libp2p attribute.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.relay.circuit_v2.resources import RelayResourceManager
from libp2p.stream_muxer import muxer_multistream as _muxer_multistream
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable
from libp2p.stream_muxer.yamux import yamux as _yamux_module
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, GO_AWAY_NORMAL, Yamux, YamuxStream

from swarm.errors import SwarmError

log = logging.getLogger("swarm.net.libp2p_patches")

PINNED_VERSION = "0.8.1"
FRAME_WRITE_TIMEOUT_S = 10.0  # one muxer frame's write, once begun; longer: the connection is closed
CLOSE_TIMEOUT = 3.0
# Streams a peer may open on one connection before it is admitted. An honest dialer opens the
# admission stream plus identify, maybe identify-push, ping and DCUtR; an outsider opened ~5,000
# in one 6 s admission window.
PRE_ADMISSION_STREAMS = 8

StreamHandler = Callable[[Any], Awaitable[None]]
Gate = Callable[[str, Any, StreamHandler], Awaitable[None]]


class Libp2pVersionError(SwarmError):
    """The installed py-libp2p is not the version these adaptations were written for."""


def installed_version() -> str:
    return importlib.metadata.version("libp2p")


def check_version(version: str | None = None) -> None:
    """Libp2pVersionError unless py-libp2p is exactly :data:`PINNED_VERSION`."""
    found = installed_version() if version is None else version
    if found != PINNED_VERSION:
        raise Libp2pVersionError(
            f"py-libp2p {found} is installed, but shard-swarm adapts private parts of py-libp2p "
            f"{PINNED_VERSION} only (swarm/net/libp2p_patches.py): install libp2p=={PINNED_VERSION}"
        )


class WindowViolation(trio.TooSlowError):
    """A peer sent past a yamux receive window. A subclass of TooSlowError on purpose: that is
    the one exception every DATA path of ``Yamux.handle_incoming`` answers by closing the
    connection (its other handlers log and carry on)."""


class GuardedYamuxStream(YamuxStream):
    """A yamux stream whose receive window is enforced, not just logged, and does not grow
    before admission: py-libp2p doubles a stream's window on every read within four RTTs, so
    the few small reads of protocol negotiation alone gave an outsider 2-4 MiB per stream."""

    def _apply_autotune_epoch(self, buffered: int) -> int:
        conn = self.muxed_conn
        if getattr(conn, "pending_admission", None) or getattr(conn, "narrow", False):
            return 0  # before admission, and for a client (it sends prompts, not tensors)
        return int(super()._apply_autotune_epoch(buffered))

    @property  # type: ignore[override]
    def recv_window(self) -> int:
        return self._recv_window

    @recv_window.setter
    def recv_window(self, value: int) -> None:
        if value < 0:
            conn: Any = self.muxed_conn
            over = -value
            log.warning("peer %s sent %d bytes past the receive window of yamux stream %d: closing the connection",
                        getattr(conn, "peer_id", "?"), over, self.stream_id)  # fmt: skip
            conn.event_shutting_down.set()
            raise WindowViolation(f"yamux stream {self.stream_id}: {over} bytes past the receive window")
        self._recv_window = value


class WholeFrameYamux(Yamux):
    """yamux whose frame writes a cancellation cannot tear, and which bounds what an unadmitted
    peer may make it hold.

    Writes: waiting for the write lock stays cancellable (nothing is encrypted yet); the write
    itself is shielded and bounded by FRAME_WRITE_TIMEOUT_S; past that the connection is *torn*
    (a partial frame may be out), closed, and every later write fails at once. ``close()`` while
    a write is stuck closes the socket first, which ends the write.

    Reads: a DATA frame longer than any window this side has open is refused before its body is
    read. ``pending_admission`` is set by the SwarmHost that governs the connection (None: no
    admission here, e.g. an open relay); while it is True at most PRE_ADMISSION_STREAMS inbound
    streams are accepted, and the next one closes the connection.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._torn = ""
        self._writing = False
        self.pending_admission: bool | None = None
        self.narrow = False  # set for a client's connection: windows never grow
        self.pre_admission_streams = 0

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

    def widest_window(self) -> int:
        """The most one DATA frame may carry: a new stream's window, or the widest open one."""
        return max([DEFAULT_WINDOW_SIZE, *(int(s.recv_window) for s in list(self.streams.values()))])

    async def _read_data_body(self, length: int) -> bytes:
        if length > self.widest_window():
            self.event_shutting_down.set()
            log.warning("peer %s announced a %d-byte yamux DATA frame, wider than any window open: "
                        "closing the connection", self.peer_id, length)  # fmt: skip
            raise WindowViolation(f"a {length}-byte DATA frame exceeds every receive window")
        return await super()._read_data_body(length)

    async def accept_stream(self) -> Any:
        stream = await super().accept_stream()
        if not self.pending_admission:
            return stream
        self.pre_admission_streams += 1
        if self.pre_admission_streams <= PRE_ADMISSION_STREAMS:
            return stream
        log.warning("peer %s opened more than %d streams before admission: closing the connection",
                    self.peer_id, PRE_ADMISSION_STREAMS)  # fmt: skip
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
            await stream.reset()
        self.event_shutting_down.set()
        raise MuxedConnUnavailable(f"more than {PRE_ADMISSION_STREAMS} streams before admission")


_applied = False


def apply() -> None:
    """Install the process-wide adaptations (after checking the version). Idempotent."""
    global _applied
    if _applied:
        return
    check_version()
    _muxer_multistream.Yamux = WholeFrameYamux  # type: ignore[misc]
    _yamux_module.YamuxStream = GuardedYamuxStream  # type: ignore[misc]
    _applied = True


# ---------------------------------------------------------------------------- per host


class _GatedHandlers(dict):  # type: ignore[type-arg]
    """The multiselect's protocol -> handler table, with every handler stored behind ``gate``
    (except the protocols in ``open_protocols``), however it is registered."""

    def __init__(self, gate: Gate, open_protocols: frozenset[str], existing: dict[Any, Any]) -> None:
        super().__init__()
        self._gate = gate
        self._open = open_protocols
        for k, v in existing.items():
            self[k] = v

    def __setitem__(self, protocol: Any, handler: Any) -> None:
        if handler is None or protocol is None or str(protocol) in self._open:
            super().__setitem__(protocol, handler)
            return
        gate, name = self._gate, str(protocol)

        async def gated(stream: Any) -> None:
            await gate(name, stream, handler)

        super().__setitem__(protocol, gated)


def govern_host(
    libp2p_host: Any, *, gate: Gate, open_protocols: frozenset[str], is_admitted: Callable[[str], bool]
) -> None:
    """Put every stream handler of ``libp2p_host`` (present and future) behind ``gate``, except
    ``open_protocols``; run outbound identify only towards peers ``is_admitted`` says yes to."""
    ms = libp2p_host.get_mux()
    ms.handlers = _GatedHandlers(gate, open_protocols, dict(ms.handlers))
    original = libp2p_host._should_identify_peer

    def should_identify(peer_id: Any) -> bool:
        return is_admitted(str(peer_id)) and bool(original(peer_id))

    libp2p_host._should_identify_peer = should_identify


def identify_now(libp2p_host: Any, peer_id: Any) -> None:
    """Start identify towards a peer just admitted (refused while it was not)."""
    with contextlib.suppress(Exception):
        libp2p_host._schedule_identify(peer_id, reason="admitted")


def muxed_conns(libp2p_host: Any, peer_id: Any) -> list[Any]:
    """The muxed connections (ours: WholeFrameYamux) to ``peer_id``."""
    try:
        return [c.muxed_conn for c in libp2p_host.get_network().get_connections(peer_id)]
    except Exception:
        return []


def forget_dial_failure(libp2p_host: Any, peer: str) -> None:
    """py-libp2p refuses every dial to a peer for 60 s after one failed (a private "negative
    cache"), even to a new address; callers that retry on purpose, with their own backoff,
    clear it first."""
    cache = getattr(libp2p_host.get_network(), "_negative_peer_cache", None)
    if cache is not None:
        with contextlib.suppress(Exception):
            cache.evict(peer)


def local_port(conn: Any) -> int | None:
    """The local TCP port of a libp2p connection (best effort: walks py-libp2p's wrapper chain,
    whose attribute names differ per layer)."""
    todo: list[Any] = [conn]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or len(seen) > 40:
            continue
        seen.add(id(obj))
        sock = getattr(obj, "socket", None)
        if sock is not None and hasattr(sock, "getsockname"):
            with contextlib.suppress(Exception):
                return int(sock.getsockname()[1])
        for name in ("muxed_conn", "secured_conn", "conn", "raw_conn", "stream", "_stream"):
            todo.append(getattr(obj, name, None))
    return None


def dcutr_busy(dcutr: Any, peer_id: Any) -> bool:
    """Whether DCUtR is punching towards ``peer_id`` right now."""
    return peer_id in getattr(dcutr, "_in_progress", ())


def reset_punch_budget(dcutr: Any, peer_id: Any) -> None:
    """DCUtR gives each peer 3 attempts for good; our own retries start a fresh budget."""
    with contextlib.suppress(Exception):
        dcutr._hole_punch_attempts.pop(peer_id, None)


async def register_relay(discovery: Any, peer_id: Any) -> None:
    """Register a relay with RelayDiscovery without its auto-reservation (it decides from
    identify's protocol list, which may not be there yet, and caches a "no" for good)."""
    if peer_id not in discovery.get_relays():
        await discovery._add_relay(peer_id)


class PolicedReservations(RelayResourceManager):
    """py-libp2p's relay reservations, bounded for a relay that outsiders can reach.

    py-libp2p keeps a reservation for its full TTL (1 h) after its peer disconnected and counts
    it against the relay's total, so four peers that reserved and left filled a 4-slot relay
    and then a member was refused. Here a reservation lasts only while its peer is connected
    (a departed peer's slot is freed the next time anyone asks), and one IP address holds at
    most ``per_ip`` of them (one per identity already holds: a peer has one reservation).
    """

    def __init__(self, limits: Any, host: Any, *, per_ip: int) -> None:
        super().__init__(limits, host)
        self.per_ip = per_ip

    def _ip_of(self, peer_id: Any) -> str:
        """The address ``peer_id``'s reservations count against (``address_key``)."""
        network = self.host.get_network() if self.host is not None else None
        for conn in (getattr(network, "connections", {}) or {}).get(peer_id, []) or []:
            with contextlib.suppress(Exception):
                return address_key(str(conn.muxed_conn.secured_conn.get_remote_address()[0]))
        return address_key("")

    def free_departed(self) -> int:
        """Drop the reservations of peers no longer connected; how many were dropped."""
        gone = [p for p in list(self._reservations) if not self._is_peer_connected(p)]
        for p in gone:
            del self._reservations[p]
        return len(gone)

    def can_accept_reservation(self, peer_id: Any) -> bool:
        self._clean_expired()
        self.free_departed()
        existing = self._reservations.get(peer_id)
        if existing is not None and not existing.is_expired():
            return True
        if len(self._reservations) >= self.limits.max_reservations:
            return False
        ip = self._ip_of(peer_id)
        same = sum(1 for p in self._reservations if self._ip_of(p) == ip)
        if same >= self.per_ip:
            log.warning("relay: refused a reservation to %s: %d already held from %s", peer_id, same, ip)
            return False
        return True

    def held(self) -> dict[str, str]:
        """peer ID -> IP of every reservation held now (for tests and status)."""
        return {str(p): self._ip_of(p) for p in self._reservations}


def address_key(ip: str) -> str:
    """What one party's reservations are counted by: an IPv4 address; an IPv6 address's /64 (one
    home or host is given a whole /64: one party could otherwise take every slot); every address
    we cannot tell counts as one ("unknown")."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return "unknown"
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def police_reservations(protocol: Any, *, per_ip: int) -> PolicedReservations:
    """Put :class:`PolicedReservations` under a CircuitV2Protocol (which builds its own)."""
    manager = PolicedReservations(protocol.limits, protocol.host, per_ip=per_ip)
    protocol.resource_manager = manager
    return manager


__all__ = [
    "PINNED_VERSION",
    "PRE_ADMISSION_STREAMS",
    "PolicedReservations",
    "GuardedYamuxStream",
    "Libp2pVersionError",
    "WholeFrameYamux",
    "WindowViolation",
    "address_key",
    "apply",
    "check_version",
    "dcutr_busy",
    "forget_dial_failure",
    "govern_host",
    "identify_now",
    "local_port",
    "muxed_conns",
    "police_reservations",
    "register_relay",
    "reset_punch_budget",
]
