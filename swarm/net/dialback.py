"""Reachability: our own dial-back check and the NAT classification it allows.

Theory of operation
-------------------
py-libp2p 0.8.1's AutoNAT v1 reports PUBLIC even for a dead address, so we ask a helper we are
already connected to (a bootstrap node serves :data:`DIALBACK_PROTOCOL`) to *dial us back*:

1. The client sends ``{"ports": [...]}`` (its TCP listen ports, at most :data:`MAX_PORTS`) as one
   JSON line on a fresh stream.
2. The helper takes the IP address it sees the client's connection come from — and only that IP,
   so it can never be aimed at a third party — and opens a *new* libp2p connection to
   ``/ip4/<that ip>/tcp/<port>`` for each port, bounded by a timeout. Noise proves that whoever
   answers holds the client's key, so a dial-back succeeds only if the client itself is
   reachable there. The probe connection is closed at once.
3. It answers one JSON line: the observed address and, per port, whether the dial-back worked.

From the observed address and the results we classify (:class:`Reachability`): PUBLIC when a
dial-back worked; NAT_RELAYED when none did but we hold a relay reservation; NAT_UNREACHABLE when
neither (we can dial out, nobody can dial in); OFFLINE when no bootstrap answered. The NAT's
mapping behaviour is estimated from the observed port: if it equals the local port of our
connection the NAT preserves ports (hole punching usually works); if not, it rewrites them, which
is typical of symmetric NATs where DCUtR fails and traffic stays relayed.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from swarm.errors import PeerError, PeerTimeout, ProtocolError, UsageError
from swarm.net import libp2p_patches
from swarm.net.door import close_raw

log = logging.getLogger("swarm.net.dialback")

DIALBACK_PROTOCOL = "/shard-swarm/dialback/1"
MAX_PORTS = 4
MAX_LINE = 2048
DIALBACK_TIMEOUT = 4.0  # per dial-back attempt, on the helper's side
IO_TIMEOUT = 5.0


class Reachability(StrEnum):
    PUBLIC = "public"
    NAT_RELAYED = "behind NAT, reachable via relay"
    NAT_UNREACHABLE = "behind NAT, not reachable"
    OFFLINE = "no bootstrap node reachable"


class NatKind(StrEnum):
    NONE = "no NAT"
    PORT_PRESERVING = "port-preserving NAT"
    PORT_CHANGING = "NAT that changes ports"
    UNKNOWN = "unknown"


# -- wire helpers -----------------------------------------------------------------------------


async def _read_line(stream: Any, *, timeout: float, peer: str) -> dict[str, Any]:
    buf = b""
    with trio.move_on_after(timeout) as scope:
        while b"\n" not in buf:
            chunk = await stream.read(MAX_LINE)
            if not chunk:
                raise PeerError(f"peer {peer}: dial-back stream closed before a reply")
            buf += chunk
            if len(buf) > MAX_LINE:
                raise ProtocolError(f"peer {peer}: dial-back message over {MAX_LINE} bytes")
    if scope.cancelled_caught:
        raise PeerTimeout(f"peer {peer}: no dial-back message within {timeout:g}s")
    try:
        msg = json.loads(buf.split(b"\n", 1)[0])
    except ValueError as exc:
        raise ProtocolError(f"peer {peer}: dial-back message is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"peer {peer}: dial-back message is not a JSON object")
    return msg


async def _write_line(stream: Any, msg: dict[str, Any], *, timeout: float) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    with trio.fail_after(timeout):
        await stream.write(data)


def _tcp_ports(addrs: Sequence[Any]) -> list[int]:
    ports: list[int] = []
    for a in addrs:
        text = str(a)
        if "/p2p-circuit" in text:
            continue
        with contextlib.suppress(Exception):
            port = int(multiaddr.Multiaddr(text).value_for_protocol("tcp"))
            if port and port not in ports:
                ports.append(port)
    return ports[:MAX_PORTS]


# -- the helper's side ------------------------------------------------------------------------


def serve_dialback(host: Any, *, timeout: float = DIALBACK_TIMEOUT) -> None:
    """Serve :data:`DIALBACK_PROTOCOL` on a libp2p host (bootstrap nodes do)."""

    async def handler(stream: Any) -> None:
        peer_id = stream.muxed_conn.peer_id
        peer = str(peer_id)
        try:
            req = await _read_line(stream, timeout=IO_TIMEOUT, peer=peer)
            remote = stream.get_remote_address()
            addrs = [str(a) for a in stream.muxed_conn.get_transport_addresses()] if hasattr(
                stream.muxed_conn, "get_transport_addresses") else []  # fmt: skip
            if remote is None or any("/p2p-circuit" in a for a in addrs):
                await _write_line(stream, {"error": "relayed connection: cannot dial back"},
                                  timeout=IO_TIMEOUT)  # fmt: skip
                return
            ip, port = remote[0], int(remote[1])
            ports = req.get("ports")
            if not isinstance(ports, list) or not all(
                isinstance(p, int) and 0 < p < 65536 for p in ports
            ):
                raise ProtocolError(f"peer {peer}: dial-back ports must be a list of TCP ports")
            results = []
            network = host.get_network()
            with contextlib.suppress(Exception):
                network.protect(peer_id, "swarm-dialback")
            try:
                for p in ports[:MAX_PORTS]:
                    results.append(await _probe(host, peer_id, ip, p, timeout))
            finally:
                with contextlib.suppress(Exception):
                    network.unprotect(peer_id, "swarm-dialback")
            family = "ip6" if ipaddress.ip_address(ip).version == 6 else "ip4"
            await _write_line(
                stream, {"observed": f"/{family}/{ip}/tcp/{port}", "results": results},
                timeout=IO_TIMEOUT,
            )  # fmt: skip
        except (PeerError, ProtocolError) as exc:
            log.info("dial-back for %s: %s", peer, exc)
        except Exception as exc:  # never let a handler error escape into libp2p
            log.info("dial-back for %s failed: %s: %s", peer, type(exc).__name__, exc)
        finally:
            await close_raw(stream)

    host.set_stream_handler(TProtocol(DIALBACK_PROTOCOL), handler)


async def _probe(host: Any, peer_id: ID, ip: str, port: int, timeout: float) -> dict[str, Any]:
    family = "ip6" if ipaddress.ip_address(ip).version == 6 else "ip4"
    addr = multiaddr.Multiaddr(f"/{family}/{ip}/tcp/{port}")
    t0 = time.monotonic()
    conn = None
    try:
        with trio.fail_after(timeout):
            conn = await host.get_network().dial_addr(addr, peer_id)
        return {"port": port, "ok": True, "ms": round((time.monotonic() - t0) * 1000, 1)}
    except trio.TooSlowError:
        return {"port": port, "ok": False, "error": f"no answer within {timeout:g}s"}
    except Exception as exc:
        return {"port": port, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        if conn is not None:
            await close_raw(conn)


# -- the client's side ------------------------------------------------------------------------


@dataclass(frozen=True)
class DialbackResult:
    helper: str  # peer ID of the node that dialed back
    observed: str  # our address as the helper saw it (/ip4/<ip>/tcp/<port>)
    local_port: int | None  # local port of our connection to the helper
    reachable_ports: tuple[int, ...]
    failed: tuple[tuple[int, str], ...]  # (port, reason)

    @property
    def reachable(self) -> bool:
        return bool(self.reachable_ports)


async def dialback_check(
    host: Any, helper_peer: str, *, ports: Sequence[int] | None = None, timeout: float = 15.0
) -> DialbackResult:
    """Ask ``helper_peer`` (already connected) to dial us back on our listen ports.

    Raises PeerTimeout / PeerError when the helper does not answer or does not serve the
    protocol, ProtocolError when it answers nonsense.
    """
    pid = ID.from_base58(helper_peer)
    ports = list(ports) if ports is not None else _tcp_ports(host.get_addrs())
    if not ports:
        raise UsageError("dial-back needs a TCP listen port (is the host listening?)")
    network = host.get_network()
    # The probe connection is a second one to the helper: protect the helper meanwhile so the
    # per-peer connection cap does not trim our main connection to it.
    with contextlib.suppress(Exception):
        network.protect(pid, "swarm-dialback")
    try:
        return await _dialback_exchange(host, pid, helper_peer, ports, timeout)
    finally:
        with contextlib.suppress(Exception):
            network.unprotect(pid, "swarm-dialback")


async def _dialback_exchange(
    host: Any, pid: ID, helper_peer: str, ports: list[int], timeout: float
) -> DialbackResult:
    with trio.move_on_after(timeout) as scope:
        try:
            stream = await host.new_stream(pid, [TProtocol(DIALBACK_PROTOCOL)])
        except Exception as exc:
            raise PeerError(
                f"peer {helper_peer} does not serve {DIALBACK_PROTOCOL}: {exc}"
            ) from exc
        try:
            local = libp2p_patches.local_port(stream.muxed_conn)
            await _write_line(stream, {"ports": ports[:MAX_PORTS]}, timeout=IO_TIMEOUT)
            reply = await _read_line(stream, timeout=timeout, peer=helper_peer)
        finally:
            await close_raw(stream)
    if scope.cancelled_caught:
        raise PeerTimeout(f"peer {helper_peer}: no dial-back answer within {timeout:g}s")
    if "error" in reply:
        raise PeerError(f"peer {helper_peer} cannot dial back: {str(reply['error'])[:200]}")
    observed, results = reply.get("observed"), reply.get("results")
    if not isinstance(observed, str) or not isinstance(results, list):
        raise ProtocolError(f"peer {helper_peer}: malformed dial-back answer")
    ok, failed = [], []
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("port"), int):
            raise ProtocolError(f"peer {helper_peer}: malformed dial-back result {r!r:.80}")
        if r.get("ok") is True:
            ok.append(r["port"])
        else:
            failed.append((r["port"], str(r.get("error", "failed"))[:200]))
    return DialbackResult(helper_peer, observed, local, tuple(ok), tuple(failed))


def _observed_ip_port(observed: str) -> tuple[str, int] | None:
    with contextlib.suppress(Exception):
        ma = multiaddr.Multiaddr(observed)
        return ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp"))
    return None


def nat_kind(result: DialbackResult, local_ips: Sequence[str]) -> NatKind:
    """Estimate the NAT from what the helper saw versus our own addresses and port."""
    parsed = _observed_ip_port(result.observed)
    if parsed is None:
        return NatKind.UNKNOWN
    ip, port = parsed
    if ip in local_ips:
        return NatKind.NONE
    if result.local_port is None:
        return NatKind.UNKNOWN
    return NatKind.PORT_PRESERVING if port == result.local_port else NatKind.PORT_CHANGING


def classify(dialback: DialbackResult | None, *, relayed: bool, bootstrap_ok: bool) -> Reachability:
    """Node-level reachability from the dial-back and whether we hold a relay reservation."""
    if dialback is not None and dialback.reachable:
        return Reachability.PUBLIC
    if not bootstrap_ok:
        return Reachability.OFFLINE
    return Reachability.NAT_RELAYED if relayed else Reachability.NAT_UNREACHABLE
