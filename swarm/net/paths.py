"""How this host reaches a peer right now (directly, only through a relay, not at all) and the
peer-address helpers the relay, the NAT checks and the CLI share.

A connection is *relayed* when its transport address goes through a circuit
(``<relay>/p2p-circuit/p2p/<peer>``); a peer is reached *directly* when at least one connection
to it is not relayed (dialed, or hole-punched: net/relay.py). Everything here reads py-libp2p's
connection table; nothing dials.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import multiaddr
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from swarm.errors import UsageError
from swarm.net import libp2p_patches


class Route(StrEnum):
    """How we are connected to a peer right now."""

    DIRECT = "direct"  # at least one non-relayed connection (dialed, or hole-punched)
    RELAYED = "relayed"  # only connections through a relay
    NONE = "none"  # not connected


def parse_peer_addr(addr: str | multiaddr.Multiaddr, *, what: str = "address") -> Any:
    """A ``.../p2p/<peer>`` multiaddr as libp2p PeerInfo; UsageError naming ``what`` if not."""
    try:
        ma = addr if isinstance(addr, multiaddr.Multiaddr) else multiaddr.Multiaddr(addr)
        return info_from_p2p_addr(ma)
    except Exception as exc:
        raise UsageError(
            f"{what} {str(addr)!r} is not a multiaddr ending in /p2p/<peer-id> "
            f"(e.g. /ip4/198.51.100.2/tcp/4001/p2p/12D3Koo...): {exc}"
        ) from exc


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """The address at which ``peer_id`` is reachable through the relay at ``relay_addr``."""
    parse_peer_addr(relay_addr, what="relay address")
    return f"{relay_addr}/p2p-circuit/p2p/{peer_id}"


def as_peer_id(peer: ID | str) -> ID:
    if isinstance(peer, ID):
        return peer
    try:
        return ID.from_base58(peer)
    except Exception as exc:
        raise UsageError(f"{peer!r} is not a libp2p peer ID: {exc}") from exc


def conn_addrs(conn: Any) -> list[str]:
    try:
        return [str(a) for a in conn.get_transport_addresses()]
    except Exception:
        return []


def path_to(host: IHost, peer: ID | str) -> Route:
    """Whether ``host`` reaches ``peer`` directly, only through a relay, or not at all."""
    conns = host.get_network().get_connections(as_peer_id(peer))
    if not conns:
        return Route.NONE
    for conn in conns:
        addrs = conn_addrs(conn)
        if addrs and all("/p2p-circuit" not in a for a in addrs):
            return Route.DIRECT
    return Route.RELAYED


HOLE_PUNCHED = "hole-punched"


def relay_of(host: IHost, peer: ID | str) -> str:
    """Peer ID of the relay our relayed connection to ``peer`` goes through ("" if none)."""
    for a in connection_addrs(host, peer):
        if "/p2p-circuit" in a:
            before = a.split("/p2p-circuit", 1)[0]
            if "/p2p/" in before:
                return before.rsplit("/p2p/", 1)[1].split("/")[0]
    return ""


def forget_dial_failure(host: IHost, peer: ID | str) -> None:
    """Let the next dial to ``peer`` really happen (py-libp2p blocks a peer for 60 s after one
    failed dial; a deliberate retry must not wait that out)."""
    libp2p_patches.forget_dial_failure(host, str(as_peer_id(peer)))


def connection_addrs(host: IHost, peer: ID | str) -> list[str]:
    """Transport addresses of every connection to ``peer`` (circuit ones contain /p2p-circuit)."""
    return [
        a for conn in host.get_network().get_connections(as_peer_id(peer)) for a in conn_addrs(conn)
    ]
