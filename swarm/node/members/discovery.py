"""Finding and reaching peers beyond the invite's bootstrap list: relays and the LAN.

``serve_relay_client`` (swarm/net/relay.py) accepts relayed connections, dials ``/p2p-circuit``
addresses, lets DCUtR hole-punch relayed connections into direct ones, and holds a relay slot on
the first bootstrap node that grants one, advertising our circuit address so peers behind other
NATs can reach us. ``serve_mdns`` announces this node on the LAN and feeds the peers it finds to
membership's dialer. Both run only on a real libp2p host (``join`` turns them on).
"""

from __future__ import annotations

import contextlib
import logging

import trio

from swarm.errors import SwarmError, UsageError
from swarm.node.members.gossip import MembershipService
from swarm.node.notices import Notices

log = logging.getLogger("swarm.node.members.discovery")
RESERVE_TIMEOUT_S = 15.0


async def serve_relay_client(service: MembershipService, host: object, bootstrap: list[str], notices: Notices) -> None:
    from swarm.net.relay import open_relay

    h: object = host
    try:
        async with open_relay(h.libp2p, admit=h.dial) as node:  # type: ignore[attr-defined]
            h.attach_relay(node)  # type: ignore[attr-defined]
            for addr in bootstrap:
                try:
                    circuit = await node.reserve(addr, timeout=RESERVE_TIMEOUT_S)
                except SwarmError as exc:
                    log.info("no relay slot at %s: %s", addr, exc)
                    continue
                notices.notice(f"reachable through relay {circuit}")
                if service.membership.update_local(addrs=h.addrs()):  # type: ignore[attr-defined]
                    service.readvertise()
                break
            await trio.sleep_forever()
    except SwarmError as exc:
        notices.notice(f"relay off: {exc}")
    finally:
        h.attach_relay(None)  # type: ignore[attr-defined]


async def serve_mdns(service: MembershipService, host: object, swarm_id: str, notices: Notices) -> None:
    try:
        from swarm.net.mdns import lan_interfaces, open_mdns
    except ImportError:
        notices.notice("mDNS discovery unavailable in this build")
        return
    interfaces = lan_interfaces()
    if not interfaces:
        notices.notice("mDNS: no LAN interface with a private IPv4 address; not announcing")
        return
    addrs = host.addrs()  # type: ignore[attr-defined]
    try:
        async with open_mdns(peer_id=service.host.peer_id, swarm_id=swarm_id, listen_addrs=addrs,
                             interfaces=interfaces) as m:  # fmt: skip
            async for found in m.discoveries():
                for addr in found.addrs:
                    with contextlib.suppress(UsageError):
                        service.add_candidate(addr, source="mdns")
    except UsageError as exc:
        notices.notice(f"mDNS off: {exc}")
