"""``join --diagnose``'s report: reachability (the dial-back check, net/dialback.py), the
bootstrap and relay state, RTTs and hole-punch readiness, with a verdict and advice.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from swarm.errors import PeerError, ProtocolError, UsageError
from swarm.net.dialback import (
    DialbackResult,
    NatKind,
    Reachability,
    classify,
    dialback_check,
    nat_kind,
)
from swarm.net.door import close_raw
from swarm.net.paths import Route, parse_peer_addr, path_to
from swarm.net.relay import RelayNode

__all__ = ["Diagnosis", "diagnose"]

log = logging.getLogger("swarm.net.nat")

async def _ping(host: Any, pid: ID) -> float:
    """One libp2p ping (/ipfs/ping/1.0.0) round trip in seconds; the caller bounds the time."""
    payload = os.urandom(32)
    stream = await host.new_stream(pid, [TProtocol("/ipfs/ping/1.0.0")])
    try:
        t0 = time.monotonic()
        await stream.write(payload)
        got = b""
        while len(got) < len(payload):
            chunk = await stream.read(len(payload) - len(got))
            if not chunk:
                raise PeerError(f"peer {pid}: ping stream closed")
            got += chunk
        if got != payload:
            raise ProtocolError(f"peer {pid}: ping echoed different bytes")
        return time.monotonic() - t0
    finally:
        await close_raw(stream)


# -- the report -------------------------------------------------------------------------------


@dataclass
class Diagnosis:
    """What ``shard-swarm join --diagnose`` prints: facts, a verdict and advice."""

    peer_id: str
    listen_addrs: list[str]
    bootstrap: list[dict[str, Any]]  # {"addr", "ok", "ms"?, "error"?}
    observed_addr: str | None
    dialback_ok_ports: list[int]
    dialback_failed: list[dict[str, Any]]
    nat: NatKind
    relay_addrs: list[str]
    reachability: Reachability
    peers: list[dict[str, str]] = field(default_factory=list)  # {"peer", "path"}
    advice: list[str] = field(default_factory=list)
    relay_error: str = ""  # why no reservation was granted (when one was tried and failed)
    hole_punch: str = ""  # DCUtR readiness: "not needed", "ready", "unlikely", "off", "unknown"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nat"] = self.nat.value
        d["reachability"] = self.reachability.value
        return d

    def lines(self) -> list[str]:
        """Human-readable report, one line per fact, advice last."""
        out = [f"peer id:       {self.peer_id}", f"reachability:  {self.reachability.value}"]
        out += [f"listening on:  {a}" for a in self.listen_addrs] or ["listening on:  (nothing)"]
        for b in self.bootstrap:
            state = f"ok ({b['ms']} ms)" if b.get("ok") else f"FAILED: {b.get('error')}"
            out.append(f"bootstrap:     {b['addr']}: {state}")
        if self.observed_addr:
            out.append(f"seen from outside as: {self.observed_addr} ({self.nat.value})")
        if self.dialback_ok_ports:
            out.append(f"dial-back:     ports {self.dialback_ok_ports} reachable from outside")
        for f in self.dialback_failed:
            out.append(f"dial-back:     port {f['port']} NOT reachable ({f['error']})")
        out += [f"relay address: {a}" for a in self.relay_addrs]
        if self.relay_error:
            out.append(f"relay slot:    FAILED: {self.relay_error}")
        if self.hole_punch:
            out.append(f"hole punching: {self.hole_punch}")
        out += [f"peer:          {p['peer']}: {p['path']}" for p in self.peers]
        out += [f"advice:        {a}" for a in self.advice]
        return out


def _advice(d: Diagnosis) -> list[str]:
    tips: list[str] = []
    ports = ", ".join(str(f["port"]) for f in d.dialback_failed) or "your listen port"
    if d.reachability is Reachability.OFFLINE:
        if not d.bootstrap:
            tips.append("no bootstrap node is configured: add one to the invite "
                        "(invite create --bootstrap MULTIADDR) or stay on one LAN (mDNS)")  # fmt: skip
        else:
            tips.append("no bootstrap node answered: check your internet connection and that "
                        "the addresses in the invite are current; peers on this LAN are still "
                        "found by mDNS")  # fmt: skip
    elif d.reachability is Reachability.PUBLIC:
        tips.append("peers can dial you directly; nothing to do")
    else:
        if d.reachability is Reachability.NAT_RELAYED:
            tips.append("peers reach you through the relay (slower); to be dialed directly, "
                        f"forward TCP port(s) {ports} on your router to this machine")  # fmt: skip
        else:
            why = f" ({d.relay_error})" if d.relay_error else ""
            tips.append(f"nobody can dial you and no bootstrap node granted a relay slot{why}; "
                        f"forward TCP port(s) {ports} on your router")  # fmt: skip
        if d.nat is NatKind.PORT_PRESERVING:
            tips.append("your NAT keeps ports: hole punching (direct connections to other "
                        "NATed peers) should work")  # fmt: skip
        elif d.nat is NatKind.PORT_CHANGING:
            tips.append("your NAT changes ports (symmetric NAT?): hole punching will likely "
                        "fail and traffic to NATed peers stays relayed; port forwarding or "
                        "UPnP on the router avoids that")  # fmt: skip
    if any(p["path"] == Route.RELAYED.value for p in d.peers):
        tips.append("some peers are only relayed: expect higher latency on those hops")
    return tips


async def diagnose(
    host: Any,
    *,
    bootstrap_addrs: Sequence[str],
    relay: RelayNode | None = None,
    local_ips: Sequence[str] = (),
    peers: Sequence[str] = (),
    timeout: float = 10.0,
    admit: Any = None,
) -> Diagnosis:
    """Check how this node is reachable and say what to do about it.

    ``host`` is the running libp2p host (``SwarmHost.libp2p``); ``bootstrap_addrs`` the
    manifest's bootstrap multiaddrs (with /p2p/); ``relay`` the node's :class:`RelayNode` (a
    reservation is attempted on the first answering bootstrap if it holds none);
    ``local_ips`` this machine's interface addresses (to tell "no NAT" from "NAT");
    ``peers`` peer IDs whose current path (direct / hole-punched / relayed) is reported.
    ``admit`` (``SwarmHost.dial``), when given, connects to each bootstrap with admission, as
    ``join`` does: a bootstrap that holds the invite drops connections that do not prove the
    secret within its admission timeout, which a bare connect plus a 4 s dial-back raced.
    Never raises for network failures: they become facts in the report.
    """
    listen = [str(a) for a in host.get_addrs() if "/p2p-circuit" not in str(a)]
    boots: list[dict[str, Any]] = []
    first_ok: tuple[str, str] | None = None
    for addr in bootstrap_addrs:
        try:
            info = parse_peer_addr(addr, what="bootstrap address")
        except UsageError as exc:
            boots.append({"addr": addr, "ok": False, "error": str(exc)})
            continue
        try:
            with trio.fail_after(timeout):
                if admit is not None:
                    await admit(addr)
                else:
                    await host.connect(info)
                rtt = await _ping(host, info.peer_id)
            boots.append({"addr": addr, "ok": True, "ms": round(rtt * 1e3, 1)})
            first_ok = first_ok or (addr, str(info.peer_id))
        except Exception as exc:
            reason = f"no answer within {timeout:g}s" if isinstance(exc, trio.TooSlowError) else (
                f"{type(exc).__name__}: {exc}")  # fmt: skip
            boots.append({"addr": addr, "ok": False, "error": reason[:200]})
    dial: DialbackResult | None = None
    dial_error: str | None = None
    if first_ok is not None:
        try:
            dial = await dialback_check(host, first_ok[1], timeout=timeout)
        except (PeerError, ProtocolError, UsageError) as exc:
            dial_error = str(exc)
    relay_error = ""
    if relay is not None and not relay.circuit_addrs and not (dial and dial.reachable):
        for b in boots:  # what join does: a slot on the first bootstrap that grants one
            if not b.get("ok"):
                continue
            try:
                await relay.reserve(b["addr"], timeout=timeout)
                relay_error = ""
                break
            except (PeerError, UsageError) as exc:
                relay_error = str(exc)[:200]
    relay_addrs = relay.circuit_addrs if relay is not None else []
    peer_rows = []
    for p in peers:
        label = relay.path_label(p) if relay is not None else path_to(host, p).value
        peer_rows.append({"peer": p, "path": label})
    d = Diagnosis(
        peer_id=str(host.get_id()),
        listen_addrs=listen,
        bootstrap=boots,
        observed_addr=dial.observed if dial else None,
        dialback_ok_ports=list(dial.reachable_ports) if dial else [],
        dialback_failed=[{"port": p, "error": e} for p, e in dial.failed]
        if dial
        else ([{"port": 0, "error": dial_error}] if dial_error else []),  # fmt: skip
        nat=nat_kind(dial, local_ips) if dial else NatKind.UNKNOWN,
        relay_addrs=relay_addrs,
        reachability=classify(dial, relayed=bool(relay_addrs), bootstrap_ok=first_ok is not None),
        peers=peer_rows,
        relay_error=relay_error,
    )
    d.hole_punch = _hole_punch_readiness(d, relay)
    d.advice = _advice(d)
    return d


def _hole_punch_readiness(d: Diagnosis, relay: RelayNode | None) -> str:
    """Whether DCUtR can turn relayed connections to other NATed peers into direct ones."""
    if d.reachability is Reachability.PUBLIC:
        return "not needed (peers dial you directly)"
    if relay is None or not relay.hole_punching:
        return "off (join --no-relay)"
    if not d.relay_addrs:
        return "not possible without a relay slot (DCUtR starts from a relayed connection)"
    if d.nat is NatKind.PORT_PRESERVING:
        return "ready (DCUtR runs on; your NAT keeps ports)"
    if d.nat is NatKind.PORT_CHANGING:
        return "unlikely (your NAT changes ports): hops to other NATed peers stay relayed"
    return "unknown (the NAT could not be classified)"
