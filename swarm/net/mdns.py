"""LAN discovery over mDNS (python-zeroconf), confined to the interfaces the node is told to use.

Theory of operation
-------------------
Every node registers one DNS-SD service of type :data:`SERVICE_TYPE` whose instance name is its
peer ID. The service's A records are the IPv4 addresses of the chosen interfaces and its SRV port
is the node's TCP listen port, so a browser rebuilds dialable multiaddrs
``/ip4/<a>/tcp/<port>/p2p/<peer>``. A wildcard listen address (0.0.0.0) is expanded to the
chosen interfaces' addresses: 0.0.0.0 is never announced (libp2p's own mDNS does that). The TXT
record carries a format version, the peer ID and :func:`swarm_tag` — a hash of the swarm ID, so
nodes of other swarms on the same LAN are ignored without learning which swarm this is, and the
swarm secret never leaves the manifest.

Zeroconf is created with ``interfaces=`` set to exactly those addresses (checked in
:func:`_zeroconf_interfaces`; an empty choice is refused instead of defaulting to "all"), so
nothing is multicast on other interfaces. The sync zeroconf API runs in its own threads; under
trio every blocking call goes through ``trio.to_thread`` and browser callbacks hop back into trio
through ``trio.from_thread`` onto a memory channel.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ifaddr
import multiaddr
import trio
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from swarm.errors import UsageError

__all__ = [
    "SERVICE_TYPE",
    "Discovered",
    "Mdns",
    "announce_addrs",
    "interface_table",
    "lan_interfaces",
    "open_mdns",
    "parse_service",
    "swarm_tag",
]

log = logging.getLogger("swarm.net.mdns")

SERVICE_TYPE = "_shard-swarm._tcp.local."
TXT_VERSION = "1"
MAX_ADDRS = 16  # addresses taken from one record; more is malformed or hostile
# Anyone on the LAN can announce records under our swarm's tag (it is a hash anyone nearby sees):
# keep at most MAX_FOUND peers, forget one not announced for FOUND_TTL_S, drop the oldest for a newcomer.
MAX_FOUND = 64
FOUND_TTL_S = 600.0
RESOLVE_TIMEOUT_MS = 3000


def swarm_tag(swarm_id: str) -> str:
    """A 16-hex-digit tag of the swarm ID for TXT records (not the secret, and not reversible)."""
    if not swarm_id:
        raise UsageError("mDNS needs a non-empty swarm ID")
    return hashlib.sha256(b"shard-swarm/mdns/v1\0" + swarm_id.encode()).hexdigest()[:16]


def interface_table() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4 addresses (from ifaddr)."""
    table: dict[str, list[str]] = {}
    for adapter in ifaddr.get_adapters():
        ips = [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
        table[adapter.nice_name] = ips
    return table


def lan_interfaces(table: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """Interfaces holding a private (RFC 1918) IPv4 address: the default LAN choice."""
    table = interface_table() if table is None else table
    chosen = []
    for name, ips in table.items():
        if any(ipaddress.ip_address(ip).is_private and not ipaddress.ip_address(ip).is_loopback
               and not ipaddress.ip_address(ip).is_link_local for ip in ips):  # fmt: skip
            chosen.append(name)
    return sorted(chosen)


def _interface_ips(interfaces: Sequence[str], table: Mapping[str, Sequence[str]]) -> list[str]:
    if not interfaces:
        raise UsageError("mDNS needs at least one interface to use (never all of them)")
    ips: list[str] = []
    for name in interfaces:
        if name not in table:
            raise UsageError(f"no network interface named {name!r} (have: {', '.join(table)})")
        v4 = [ip for ip in table[name] if ipaddress.ip_address(ip).version == 4]
        if not v4:
            raise UsageError(f"interface {name!r} has no IPv4 address to announce")
        ips += [ip for ip in v4 if ip not in ips]
    return ips


def announce_addrs(
    listen_addrs: Sequence[str],
    interfaces: Sequence[str],
    table: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[str], int]:
    """The IPv4 addresses to announce and the TCP port, from listen multiaddrs and interfaces.

    A wildcard listen address becomes the chosen interfaces' addresses; a specific one is kept
    only if it belongs to a chosen interface. Raises UsageError when nothing dialable remains.
    """
    table = interface_table() if table is None else table
    allowed = _interface_ips(interfaces, table)
    ips: list[str] = []
    port: int | None = None
    for text in listen_addrs:
        try:
            ma = multiaddr.Multiaddr(text)
            ip, tcp = ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp"))
        except Exception:
            continue  # not /ip4/.../tcp/...: nothing mDNS can announce
        if tcp == 0:
            raise UsageError(f"listen address {text} has port 0: announce after listening")
        if port is not None and tcp != port:
            continue  # one SRV port per service: keep the first
        port = tcp
        for candidate in allowed if ip == "0.0.0.0" else [ip]:
            if candidate in allowed and candidate not in ips:
                ips.append(candidate)
    if port is None or not ips:
        raise UsageError(
            f"nothing to announce over mDNS: listen addresses {list(listen_addrs)} have no "
            f"IPv4 TCP address on interfaces {list(interfaces)} ({', '.join(allowed)})"
        )
    return ips, port


def _zeroconf_interfaces(ips: Sequence[str]) -> list[str]:
    """The exact ``interfaces=`` argument for Zeroconf: explicit addresses, never a wildcard."""
    out = [str(ipaddress.IPv4Address(ip)) for ip in ips]
    if not out or any(ip in ("0.0.0.0", "255.255.255.255") for ip in out):
        raise UsageError(f"refusing to run mDNS on {list(ips)}: name the interfaces to use")
    return out


@dataclass(frozen=True)
class Discovered:
    """A peer of our swarm seen on the LAN."""

    peer_id: str
    addrs: tuple[str, ...]  # dialable multiaddrs ending in /p2p/<peer_id>


def parse_service(info: Any, tag: str) -> Discovered | None:
    """A resolved ServiceInfo as :class:`Discovered`, or None if not ours or malformed."""
    props: dict[bytes, bytes | None] = dict(info.properties or {})

    def txt(key: str) -> str:
        value = props.get(key.encode())
        return value.decode("ascii", errors="replace") if isinstance(value, bytes) else ""

    if txt("v") != TXT_VERSION or txt("swarm") != tag:
        return None
    peer = txt("peer")
    try:
        multiaddr.Multiaddr(f"/p2p/{peer}")
    except Exception:
        log.debug("mDNS record %s has a malformed peer ID", info.name)
        return None
    port = info.port
    if not isinstance(port, int) or not 0 < port < 65536:
        return None
    addrs = []
    for ip in list(info.parsed_addresses(IPVersion.V4Only))[:MAX_ADDRS]:
        parsed = ipaddress.IPv4Address(ip)
        if parsed.is_unspecified or parsed.is_multicast:
            continue
        addrs.append(f"/ip4/{ip}/tcp/{port}/p2p/{peer}")
    return Discovered(peer, tuple(addrs)) if addrs else None


@dataclass
class Mdns:
    """A running announcement (and browser): read :attr:`found` or iterate :meth:`discoveries`."""

    peer_id: str
    announced: list[str]  # the multiaddrs we announce
    interface_ips: list[str]
    found: dict[str, Discovered] = field(default_factory=dict)
    _recv: trio.MemoryReceiveChannel[Discovered] | None = None
    _seen: dict[str, float] = field(default_factory=dict)  # peer -> when its record was last resolved

    def remember(self, item: Discovered, now: float) -> bool:
        """Keep ``item`` (bounded and aged, see MAX_FOUND); True when it is news to pass on."""
        for peer in [p for p, t in self._seen.items() if now - t >= FOUND_TTL_S]:
            self.found.pop(peer, None)
            del self._seen[peer]
        known = self.found.get(item.peer_id)
        self._seen[item.peer_id] = now
        if known == item:
            return False
        if known is None and len(self.found) >= MAX_FOUND:
            oldest = min((p for p in self.found if p != item.peer_id), key=lambda p: self._seen.get(p, 0.0))
            del self.found[oldest]
            self._seen.pop(oldest, None)
        self.found[item.peer_id] = item
        return True

    async def discoveries(self) -> AsyncIterator[Discovered]:
        """Each peer of our swarm as it is seen (again when its addresses change)."""
        if self._recv is None:
            return
        async for item in self._recv:
            yield item

    async def wait_for(self, peer_id: str, *, timeout: float) -> Discovered | None:
        """Wait until ``peer_id`` is found; None after ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            while peer_id not in self.found:
                await trio.sleep(0.05)
            return self.found[peer_id]
        return None


@contextlib.asynccontextmanager
async def open_mdns(
    *,
    peer_id: str,
    swarm_id: str,
    listen_addrs: Sequence[str],
    interfaces: Sequence[str],
    browse: bool = True,
    _zeroconf_factory: Callable[..., Any] = Zeroconf,
) -> AsyncIterator[Mdns]:
    """Announce this node on ``interfaces`` (and browse for its swarm) for the block's duration.

    ``listen_addrs`` are the host's bound listen multiaddrs (real ports, no port 0). The
    announcement is withdrawn and zeroconf closed on exit, even on cancellation.
    """
    tag = swarm_tag(swarm_id)
    table = interface_table()
    ips, port = announce_addrs(listen_addrs, interfaces, table)
    zc_interfaces = _zeroconf_interfaces(_interface_ips(interfaces, table))
    info = ServiceInfo(
        SERVICE_TYPE,
        f"{peer_id}.{SERVICE_TYPE}",
        port=port,
        addresses=[ipaddress.IPv4Address(ip).packed for ip in ips],
        properties={"v": TXT_VERSION, "peer": peer_id, "swarm": tag},
        server=f"{peer_id[-16:].lower()}.local.",
    )
    mdns = Mdns(peer_id, [f"/ip4/{ip}/tcp/{port}/p2p/{peer_id}" for ip in ips], zc_interfaces)
    zc = await trio.to_thread.run_sync(
        lambda: _zeroconf_factory(interfaces=zc_interfaces, ip_version=IPVersion.V4Only)
    )
    browser: ServiceBrowser | None = None
    send, recv = trio.open_memory_channel[Discovered](64)
    names: trio.MemorySendChannel[str]
    names, names_recv = trio.open_memory_channel[str](256)
    mdns._recv = recv
    token = trio.lowlevel.current_trio_token()
    try:
        await trio.to_thread.run_sync(lambda: zc.register_service(info, allow_name_change=True))
        log.info("announcing %s over mDNS on %s", ", ".join(mdns.announced), ", ".join(ips))
        async with trio.open_nursery() as nursery:
            if browse:

                def on_change(
                    zeroconf: Zeroconf,
                    service_type: str,
                    name: str,
                    state_change: ServiceStateChange,
                ) -> None:  # runs in zeroconf's thread
                    if state_change is ServiceStateChange.Removed:
                        return
                    with contextlib.suppress(
                        trio.WouldBlock, trio.RunFinishedError, trio.Cancelled
                    ):
                        trio.from_thread.run_sync(names.send_nowait, name, trio_token=token)

                browser = await trio.to_thread.run_sync(
                    lambda: ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
                )
                nursery.start_soon(_resolver, zc, tag, peer_id, names_recv, send, mdns)
            try:
                yield mdns
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if browser is not None:
                await trio.to_thread.run_sync(browser.cancel)
            with contextlib.suppress(Exception):
                await trio.to_thread.run_sync(lambda: zc.unregister_service(info))
            await trio.to_thread.run_sync(zc.close)


async def _resolver(
    zc: Zeroconf,
    tag: str,
    own_peer: str,
    names: trio.MemoryReceiveChannel[str],
    out: trio.MemorySendChannel[Discovered],
    mdns: Mdns,
) -> None:
    """Resolve each announced name (blocking zeroconf call, in a thread) and publish ours."""
    limiter = trio.CapacityLimiter(2)

    def resolve(name: str) -> ServiceInfo | None:
        return zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)

    async for name in names:
        info = await trio.to_thread.run_sync(  # type: ignore[call-arg]
            resolve, name, limiter=limiter, abandon_on_cancel=True
        )
        if info is None:
            continue
        found = parse_service(info, tag)
        if found is None or found.peer_id == own_peer:
            continue
        if not mdns.remember(found, trio.current_time()):
            continue
        log.info("mDNS: found %s at %s", found.peer_id, ", ".join(found.addrs))
        with contextlib.suppress(trio.WouldBlock):
            out.send_nowait(found)
