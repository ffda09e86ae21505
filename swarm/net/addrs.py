"""Multiaddr helpers of the host: parsing, wildcards, what other machines can dial."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import multiaddr

from swarm.errors import UsageError


def parse_multiaddr(text: str, what: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types
        raise UsageError(f"{what}: {text!r} is not a valid multiaddr ({exc})") from None


def conn_addr(conn: Any) -> str:
    """Remote transport address of a connection, best effort ("" when unknown)."""
    with contextlib.suppress(Exception):
        addrs = conn.get_transport_addresses()
        if addrs:
            return str(addrs[0])
    with contextlib.suppress(Exception):
        ip, port = conn.muxed_conn.secured_conn.get_remote_address()
        return f"/ip4/{ip}/tcp/{port}"
    return ""


def strip_p2p(addr: str) -> str:
    i = addr.find("/p2p/")
    return addr[:i] if i >= 0 else addr


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


__all__ = ["conn_addr", "dialable_addrs", "is_wildcard", "parse_multiaddr", "strip_p2p"]
