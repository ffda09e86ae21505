"""The py-libp2p host as shard-swarm builds it, for a SwarmHost and a relay-only host alike.

:func:`build_libp2p_host` makes a py-libp2p 0.8.1 host from a node's 32-byte Ed25519 seed with an
explicit Noise-only security table and a yamux-only muxer table (the library's defaults also
accept plaintext, secio and TLS, which would let a dialer claim another peer's ID), after the
pinned-version check and the process-wide adaptations (``libp2p_patches.apply``).
``ConnectionConfig(max_connections_per_peer=1)`` avoids the fixed 250 ms wait in ``connect()``;
the auto-connector's minimums are zeroed so the library never redials a peer we dropped.
:class:`ConnectionNotifee` forwards connection events (host.py hands them to its door).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import multiaddr
from libp2p import new_host
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from swarm.errors import UsageError
from swarm.net import libp2p_patches
from swarm.net.libp2p_patches import WholeFrameYamux

DEFAULT_DIAL_TIMEOUT = 10.0


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


class ConnectionNotifee(INotifee):
    """Tells ``on_connected`` / ``on_disconnected`` of every connection opened or closed (py-libp2p's
    notifee interface; the other events are ignored)."""

    def __init__(self, on_connected: Callable[[INetConn], None], on_disconnected: Callable[[INetConn], None]) -> None:
        self._on_connected, self._on_disconnected = on_connected, on_disconnected

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._on_connected(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._on_disconnected(conn)

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None
