"""Circuit relay v2 (reservations, relayed dials) and DCUtR hole punching on a libp2p host.

Theory of operation
-------------------
A node behind a NAT cannot be dialed. It keeps an outbound connection to a public relay (our
bootstrap node) and *reserves a slot* there; other peers then dial it through the relay at the
circuit address ``<relay-addr>/p2p-circuit/p2p/<node>``. A relayed connection is a yamux stream
on the relay leg, upgraded end-to-end with Noise, so the relay forwards bytes it cannot read.

Once two peers share a relayed connection, DCUtR (Direct Connection Upgrade through Relay) has
them exchange their observed public addresses over it and dial each other at the same moment,
each from its listen port. With endpoint-independent, port-preserving NATs (the common home
router, Linux MASQUERADE) the crossing SYNs open both NAT mappings and a direct TCP connection
forms; with symmetric NATs (``--random-fully``) it cannot, and the peers stay relayed.

py-libp2p 0.8.1 provides the pieces (``CircuitV2Protocol``, ``CircuitV2Transport``,
``RelayDiscovery``, ``DCUtRProtocol``) but does not wire them into its host, and a host does not
reserve a slot by itself: :func:`open_relay` starts the services beside a host and
:class:`RelayNode` offers the few operations the node needs, each bounded by a timeout and
raising only :mod:`swarm.errors` exceptions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from swarm.errors import PeerError, PeerTimeout, UsageError
from swarm.net import libp2p_patches
from swarm.net.paths import (
    HOLE_PUNCHED,
    Route,
    as_peer_id,
    circuit_addr,
    forget_dial_failure,
    parse_peer_addr,
    path_to,
    relay_of,
)

__all__ = [
    "DCUTR_PROTOCOL",
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "RelayNode",
    "RelayPolicy",
    "open_relay",
    "open_relay_host",
]

log = logging.getLogger("swarm.net.relay")

# Reservations last an hour on a py-libp2p relay (RelayConfig.reservation_ttl): renew well before.
REFRESH_S = 600.0
PUNCH_RETRY_S = 6.0  # between our own hole-punch rounds on a relayed-only peer
PUNCH_ROUNDS = 8  # ... at most this many (then the hop stays relayed)

# Called with a peer's address right after a connection to it exists (SwarmHost.dial: it runs
# admission on the existing connection, which a SwarmHost requires of every peer, relays too).
Admit = Callable[[str], Awaitable[Any]]


@dataclass(frozen=True)
class RelayPolicy:
    """What a relay grants each reserving peer (circuit-relay v2 "limits").

    The defaults suit a small friends' swarm: a few dozen reservations, circuits long enough to
    hold a relayed ring if punching fails (a symmetric NAT), and a data cap per circuit so one
    peer cannot turn the bootstrap node into a free tunnel. py-libp2p enforces both caps per
    circuit (both directions together); past either the circuit ends, the peers' control link
    over it ends, and they re-dial (a ring hop on it is re-planned). A relayed hop of the
    bundled model carries ~2.3 kB per token each way in fp32 (hidden 576, plus framing), so
    16 GiB is millions of tokens; only members hold connections to a bootstrap that has the
    invite, so a day-long circuit is no open tunnel.
    """

    max_reservations: int = 64
    max_reservations_per_ip: int = 8  # peers behind one home NAT share an IP; more is one party
    max_circuits_per_peer: int = 16
    circuit_seconds: int = 24 * 3600
    circuit_bytes: int = 16 << 30

    def limits(self) -> RelayLimits:
        if min(self.max_reservations, self.max_reservations_per_ip, self.max_circuits_per_peer, self.circuit_seconds) <= 0:
            raise UsageError(f"relay policy values must be positive: {self}")
        return RelayLimits(
            duration=self.circuit_seconds,
            data=self.circuit_bytes,
            max_circuit_conns=self.max_circuits_per_peer,
            max_reservations=self.max_reservations,
        )


class RelayNode:
    """Relay-related operations of one host; made by :func:`open_relay`."""

    def __init__(
        self, host: IHost, protocol: CircuitV2Protocol, transport: CircuitV2Transport,
        dcutr: DCUtRProtocol | None, *, hop: bool, admit: Admit | None = None,
    ) -> None:  # fmt: skip
        self.host = host
        self.hop = hop
        self._admit = admit
        self._protocol = protocol
        self._transport = transport
        self._dcutr = dcutr
        self._reservations: dict[str, str] = {}  # relay addr -> our circuit addr
        self.seen_relayed: set[str] = set()  # peers we have had a relayed connection to
        self.upgraded: set[str] = set()  # of those, peers now reached directly (DCUtR)

    def reservations_held(self) -> dict[str, str]:
        """On a relay (hop): peer ID -> IP of every reservation held now."""
        manager = self._protocol.resource_manager
        return manager.held() if isinstance(manager, libp2p_patches.PolicedReservations) else {}

    @property
    def hole_punching(self) -> bool:
        """Whether this node answers and drives DCUtR upgrades."""
        return self._dcutr is not None

    @property
    def circuit_addrs(self) -> list[str]:
        """Our addresses through the relays where we hold a reservation."""
        return list(self._reservations.values())

    async def reserve(self, relay_addr: str, *, timeout: float = 15.0) -> str:
        """Connect to the relay at ``relay_addr``, reserve a slot, return our circuit address.

        Raises PeerTimeout if the relay does not answer in ``timeout`` seconds and PeerError if
        it refuses the reservation or does not speak circuit-relay v2 (hop).
        """
        info = parse_peer_addr(relay_addr, what="relay address")
        discovery = self._transport.discovery
        forget_dial_failure(self.host, info.peer_id)
        with trio.move_on_after(timeout) as scope:
            try:
                await self.host.connect(info)
            except Exception as exc:
                raise PeerError(f"cannot connect to relay {relay_addr}: {exc}") from exc
            if self._admit is not None:
                await self._admit(relay_addr)
            # RelayDiscovery.discover_relays() decides from the peerstore's protocol list, which
            # is empty until identify finishes, and caches that "no" for good. Decide ourselves
            # (identify's list, else a probe stream) and register the relay with discovery.
            if not await self._offers_hop(info.peer_id, wait=min(3.0, timeout / 3)):
                raise PeerError(
                    f"{relay_addr} does not offer circuit relay v2 ({HOP_PROTOCOL}); "
                    "is it a shard-swarm bootstrap node?"
                )
            await libp2p_patches.register_relay(discovery, info.peer_id)
            ok = await discovery.make_reservation(info.peer_id)
            if not ok:
                raise PeerError(f"relay {relay_addr} refused a reservation (it may be full)")
        if scope.cancelled_caught:
            raise PeerTimeout(f"relay {relay_addr} did not grant a reservation within {timeout}s")
        addr = circuit_addr(relay_addr, str(self.host.get_id()))
        self._reservations[relay_addr] = addr
        log.info("reserved a relay slot: reachable at %s", addr)
        return addr

    async def _offers_hop(self, peer: ID, *, wait: float) -> bool:
        """Whether ``peer`` serves the relay hop protocol (identify's answer, else a probe)."""
        store = self.host.get_peerstore()
        with trio.move_on_after(wait):
            while True:
                with contextlib.suppress(Exception):
                    protocols = [str(p) for p in store.get_protocols(peer)]
                    if protocols:
                        return str(HOP_PROTOCOL) in protocols
                await trio.sleep(0.05)
        try:  # identify did not finish in time: ask directly (the relay logs an empty stream)
            probe = await self.host.new_stream(peer, [HOP_PROTOCOL])
            await probe.close()
            return True
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception:
            return False

    async def dial_circuit(self, addr: str) -> None:
        """Open a relayed connection at a ``/p2p-circuit`` address (no admission; the caller,
        SwarmHost.dial, runs it and bounds the time). py-libp2p's host cannot dial these
        addresses itself: its Swarm drops them before dialing."""
        info = parse_peer_addr(addr, what="circuit address")
        await self._admit_relay(addr)
        forget_dial_failure(self.host, info.peer_id)
        try:
            await self._transport.dial(multiaddr.Multiaddr(addr))
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise PeerError(f"cannot reach {info.peer_id} through the relay at {addr}: {exc}") from exc
        self.seen_relayed.add(str(info.peer_id))

    async def _admit_relay(self, circuit: str) -> None:
        """Be admitted by the relay of a circuit address before asking it for a circuit: a
        relay that runs admission serves its hop protocol to admitted peers only."""
        relay_addr = circuit.split("/p2p-circuit", 1)[0]
        if self._admit is not None and "/p2p/" in relay_addr:
            await self._admit(relay_addr)

    async def dial(self, addr: str, *, timeout: float = 15.0) -> str:
        """Connect to a peer at a direct or ``/p2p-circuit`` address; return its peer ID.

        Relayed dials go through :class:`CircuitV2Transport` (the host alone cannot dial them).
        """
        info = parse_peer_addr(addr, what="peer address")
        forget_dial_failure(self.host, info.peer_id)
        with trio.move_on_after(timeout) as scope:
            try:
                if "/p2p-circuit" in addr:
                    await self._admit_relay(addr)
                    await self._transport.dial(multiaddr.Multiaddr(addr))
                    self.seen_relayed.add(str(info.peer_id))
                else:
                    await self.host.connect(info)
            except (trio.Cancelled, KeyboardInterrupt):
                raise
            except Exception as exc:
                raise PeerError(f"cannot reach {info.peer_id} at {addr}: {exc}") from exc
            if self._admit is not None:
                await self._admit(addr)
        if scope.cancelled_caught:
            raise PeerTimeout(f"no connection to {info.peer_id} at {addr} within {timeout}s")
        return str(info.peer_id)

    async def punch(self, peer: ID | str, *, timeout: float = 30.0) -> bool:
        """Try to upgrade a relayed connection to ``peer`` to a direct one (DCUtR).

        True if a direct connection exists afterwards. False (never an exception) when the
        NATs do not allow it, hole punching is off, or ``timeout`` passes: relayed still works.
        """
        pid = as_peer_id(peer)
        if path_to(self.host, pid) is Route.DIRECT:
            return True
        if self._dcutr is None:
            return False
        with trio.move_on_after(timeout):
            try:
                await self._dcutr.initiate_hole_punch(pid)
            except (trio.Cancelled, KeyboardInterrupt):
                raise
            except Exception as exc:
                log.info("hole punch to %s failed: %s", pid, exc)
        return self._observe(pid) is Route.DIRECT

    def _observe(self, peer: ID | str) -> Route:
        """The current path to ``peer``, remembering relayed-then-direct upgrades."""
        path = path_to(self.host, peer)
        key = str(peer)
        # Only a peer we reached through relays alone (dial_circuit, or seen so here) counts:
        # a spare relayed connection beside a direct one we dialed is no hole punch.
        if path is Route.RELAYED:
            self.seen_relayed.add(key)
        if path is Route.DIRECT and key in self.seen_relayed and key not in self.upgraded:
            self.upgraded.add(key)
            log.info("connection to %s upgraded from relayed to direct (hole punching)", key)
        return path

    def path_label(self, peer: ID | str) -> str:
        """How ``peer`` is reached, for people and JSON: "direct", "hole-punched" (a direct
        connection that DCUtR made from a relayed one), "relayed via <relay peer ID>", "none"."""
        path = self._observe(peer)
        if path is Route.DIRECT and str(peer) in self.upgraded:
            return HOLE_PUNCHED
        if path is Route.RELAYED:
            via = relay_of(self.host, peer)
            if via in ("", str(self.host.get_id())):
                # an inbound circuit's address names us, not the relay: it came through the
                # relay where we hold our slot
                via = next((r.rsplit("/p2p/", 1)[1] for r in self._reservations), "")
            return f"relayed via {via}" if via else "relayed"
        return path.value

    async def watch(self, *, interval: float = 0.5, refresh_s: float = REFRESH_S) -> None:
        """Track relayed connections and their upgrades to direct ones, retry hole punching on
        relayed-only peers, and renew reservations before the relay lets them lapse (runs in
        open_relay's nursery)."""
        next_refresh = trio.current_time() + refresh_s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._retry_punches)
            await self._watch(interval, refresh_s, next_refresh)

    async def _retry_punches(self) -> None:
        """py-libp2p's DCUtR drives up to 3 attempts per peer, then gives up for good; under a
        busy CPU all 3 can miss (a round lasts 5 s). From the lower peer ID of each pair (so the
        two sides do not start sessions that cross), try again every PUNCH_RETRY_S, up to
        PUNCH_ROUNDS times; a symmetric NAT stays relayed after that, which works."""
        if self._dcutr is None:
            return
        rounds: dict[str, int] = {}
        me = str(self.host.get_id())
        while True:
            await trio.sleep(PUNCH_RETRY_S)
            for peer in list(self.host.get_connected_peers()):
                key = str(peer)
                if key > me or rounds.get(key, 0) >= PUNCH_ROUNDS or path_to(self.host, peer) is not Route.RELAYED:
                    continue
                if libp2p_patches.dcutr_busy(self._dcutr, peer):
                    continue
                rounds[key] = rounds.get(key, 0) + 1
                libp2p_patches.reset_punch_budget(self._dcutr, peer)  # its own budget of 3
                ok = await self.punch(peer, timeout=PUNCH_RETRY_S * 2)
                log.info("hole punch to %s, round %d: %s", key, rounds[key], "direct" if ok else "still relayed")

    async def _watch(self, interval: float, refresh_s: float, next_refresh: float) -> None:
        while True:
            for peer in list(self.host.get_connected_peers()):
                self._observe(peer)
            if trio.current_time() >= next_refresh:
                next_refresh = trio.current_time() + refresh_s
                for relay_addr in list(self._reservations):
                    try:
                        await self.reserve(relay_addr, timeout=15.0)
                    except (PeerError, UsageError) as exc:
                        log.warning("could not renew the relay slot at %s: %s", relay_addr, exc)
            await trio.sleep(interval)

    async def settle(self, peer: ID | str, *, timeout: float) -> str:
        """Before a long-lived stream goes to ``peer``: if we reach it only through a relay and
        hole punching may still work, give DCUtR up to ``timeout`` to make the direct connection
        first (the higher peer ID of the pair drives, as in _retry_punches; the other waits).
        Streams on a relayed connection die when a direct one replaces it. Returns the label."""
        pid = as_peer_id(peer)
        if self._dcutr is None or path_to(self.host, pid) is not Route.RELAYED:
            return self.path_label(pid)
        if str(pid) > str(self.host.get_id()):
            await self.wait_direct(pid, timeout=timeout)
        else:
            with trio.move_on_after(timeout):
                while path_to(self.host, pid) is Route.RELAYED:
                    libp2p_patches.reset_punch_budget(self._dcutr, pid)
                    if await self.punch(pid, timeout=timeout):
                        break
                    await trio.sleep(0.5)
        label = self.path_label(pid)
        log.info("path to %s before linking: %s", pid, label)
        return label

    async def wait_direct(self, peer: ID | str, *, timeout: float) -> bool:
        """Wait until ``peer`` is reachable directly (e.g. the other side punched); True if so."""
        pid = as_peer_id(peer)
        with trio.move_on_after(timeout):
            while self._observe(pid) is not Route.DIRECT:
                await trio.sleep(0.1)
            return True
        return False


@contextlib.asynccontextmanager
async def open_relay(
    host: IHost,
    *,
    hop: bool = False,
    hole_punch: bool = True,
    policy: RelayPolicy | None = None,
    admit: Admit | None = None,
) -> AsyncIterator[RelayNode]:
    """Run circuit-relay v2 (and DCUtR) beside a running ``host`` for the ``async with`` body.

    ``hop=True`` makes the host a relay for others (the bootstrap node); every host accepts
    relayed connections (stop) and can dial and reserve through relays (client). With
    ``hole_punch`` the host answers and drives DCUtR upgrades of its relayed connections.
    The services stop, and their stream handlers are removed, when the block exits.
    With a SwarmHost pass ``host=swarm_host.libp2p, admit=swarm_host.dial`` so the relay and
    every peer reached through it are admitted (a SwarmHost drops unadmitted connections).
    """
    policy = policy or RelayPolicy()
    limits = policy.limits()
    roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if hop else RelayRole(0))
    config = RelayConfig(roles=roles, limits=limits)
    protocol = CircuitV2Protocol(host, limits=limits, allow_hop=hop)
    libp2p_patches.police_reservations(protocol, per_ip=policy.max_reservations_per_ip)
    async with background_trio_service(protocol), trio.open_nursery() as nursery:
        transport = CircuitV2Transport(host, protocol, config)
        if not hole_punch:
            node = RelayNode(host, protocol, transport, None, hop=hop, admit=admit)
            nursery.start_soon(node.watch)
            yield node
            nursery.cancel_scope.cancel()
            return
        dcutr = DCUtRProtocol(host)
        async with background_trio_service(dcutr):
            await dcutr.event_started.wait()
            node = RelayNode(host, protocol, transport, dcutr, hop=hop, admit=admit)
            nursery.start_soon(node.watch)
            yield node
            nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def open_relay_host(
    seed: bytes,
    listen: Sequence[str],
    *,
    secret: bytes | None = None,
    swarm_id: str = "",
    revoked: frozenset[str] = frozenset(),
) -> AsyncIterator[Any]:
    """A running libp2p host for a bootstrap/relay node; yields the libp2p host.

    With the swarm ``secret`` (and ``swarm_id``, ``revoked`` from the manifest) it is a SwarmHost (net/host.py: Noise-only, yamux-only, admission
    of every peer); without one a bare host with the same Noise/yamux-only security and no
    admission (an open relay).
    """
    from swarm.net.host import open_host
    from swarm.net.libp2p_host import build_libp2p_host

    if secret is not None:
        async with open_host(
            seed, listen, secret=secret, swarm_id=swarm_id, revoked=revoked
        ) as swarm_host:
            yield swarm_host.libp2p
        return
    try:
        addrs = [multiaddr.Multiaddr(a) for a in listen]
    except Exception as exc:
        raise UsageError(f"listen address in {list(listen)} is not a multiaddr: {exc}") from exc
    host = build_libp2p_host(seed, addrs)
    try:
        async with host.run(addrs):
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(3.0):
                    await host.close()
    except OSError as exc:
        raise PeerError(f"cannot listen on {', '.join(listen)}: {exc}") from None
