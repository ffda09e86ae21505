"""Finding peers beyond the bootstrap list (node/members/discovery.py), with the libp2p relay and
the mDNS responder replaced by fakes (their own tests: tests/net/test_relay.py, test_mdns.py):
the first bootstrap node that grants a relay slot is used and advertised, a node that grants none
is skipped, the relay is detached however the task ends; mDNS feeds every address it finds to
membership's dialer, skips one the dialer refuses, and says plainly when it cannot run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import trio

import swarm.net.mdns as mdns
import swarm.net.relay as relay
from swarm.errors import PeerError, PeerTimeout, UsageError
from swarm.node.members.discovery import serve_mdns, serve_relay_client
from swarm.node.notices import Hooks, Notices


class _Service:
    def __init__(self) -> None:
        self.addrs: list[list[str]] = []
        self.readvertised = 0
        self.candidates: list[tuple[str, str]] = []
        self.membership = SimpleNamespace(update_local=self._update)
        self.host = SimpleNamespace(peer_id="12D3KooWMe")

    def _update(self, *, addrs: list[str]) -> bool:
        changed = not self.addrs or self.addrs[-1] != addrs
        self.addrs.append(addrs)
        return changed

    def readvertise(self) -> None:
        self.readvertised += 1

    def add_candidate(self, addr: str, source: str = "manual") -> None:
        if "bad" in addr:
            raise UsageError(f"not a dialable address: {addr}")
        self.candidates.append((addr, source))


class _Host:
    def __init__(self) -> None:
        self.libp2p, self.dial = object(), object()
        self.relays: list[Any] = []
        self.circuits: list[str] = []  # what the attached relay has reserved

    def attach_relay(self, node: Any) -> None:
        self.relays.append(node)

    def addrs(self) -> list[str]:
        attached = bool(self.relays) and self.relays[-1] is not None
        return ["/ip4/10.0.0.2/tcp/4001", *(self.circuits if attached else [])]


def _notices() -> tuple[Notices, list[str]]:
    shown: list[str] = []
    return Notices(Hooks(on_event=shown.append)), shown


async def test_the_first_bootstrap_that_grants_a_slot_is_advertised_and_the_relay_detached_at_the_end(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    asked: list[str] = []
    service, host = _Service(), _Host()

    class Node:
        async def reserve(self, addr: str, *, timeout: float) -> str:
            asked.append(addr)
            if addr == "/dns/full":
                raise PeerError("no slot free")
            if addr == "/dns/slow":
                raise PeerTimeout("no answer")
            host.circuits.append(f"{addr}/p2p-circuit/p2p/12D3KooWMe")
            return host.circuits[-1]

    @contextlib.asynccontextmanager
    async def fake_open_relay(libp2p: Any, *, admit: Any) -> AsyncIterator[Node]:
        yield Node()

    monkeypatch.setattr(relay, "open_relay", fake_open_relay)
    notices, shown = _notices()
    with trio.move_on_after(60):
        await serve_relay_client(service, host, ["/dns/full", "/dns/slow", "/dns/ok", "/dns/never"], notices)  # type: ignore[arg-type]
    assert asked == ["/dns/full", "/dns/slow", "/dns/ok"]  # the first slot granted ends the search
    assert shown == ["reachable through relay /dns/ok/p2p-circuit/p2p/12D3KooWMe"]
    assert service.addrs[-1][-1] == "/dns/ok/p2p-circuit/p2p/12D3KooWMe" and service.readvertised == 1
    assert host.relays[0] is not None and host.relays[-1] is None  # attached while it ran, detached after


async def test_a_relay_that_cannot_start_is_said_and_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.asynccontextmanager
    async def broken(libp2p: Any, *, admit: Any) -> AsyncIterator[Any]:
        raise PeerError("circuit relay protocol unavailable")
        yield

    monkeypatch.setattr(relay, "open_relay", broken)
    host = _Host()
    notices, shown = _notices()
    await serve_relay_client(_Service(), host, ["/dns/ok"], notices)  # type: ignore[arg-type]
    assert shown == ["relay off: circuit relay protocol unavailable"] and host.relays == [None]


async def test_mdns_feeds_what_it_finds_to_the_dialer(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: dict[str, Any] = {}

    class Responder:
        async def discoveries(self) -> AsyncIterator[Any]:
            yield SimpleNamespace(addrs=["/ip4/10.0.0.7/tcp/4001/p2p/12D3KooWPeer", "/bad"])
            yield SimpleNamespace(addrs=["/ip4/10.0.0.8/tcp/4001/p2p/12D3KooWOther"])

    @contextlib.asynccontextmanager
    async def fake_open_mdns(**kw: Any) -> AsyncIterator[Responder]:
        opened.update(kw)
        yield Responder()

    monkeypatch.setattr(mdns, "lan_interfaces", lambda: ["eth0"])
    monkeypatch.setattr(mdns, "open_mdns", fake_open_mdns)
    service = _Service()
    notices, shown = _notices()
    await serve_mdns(service, _Host(), "friends", notices)  # type: ignore[arg-type]
    assert service.candidates == [("/ip4/10.0.0.7/tcp/4001/p2p/12D3KooWPeer", "mdns"),
                                  ("/ip4/10.0.0.8/tcp/4001/p2p/12D3KooWOther", "mdns")]  # fmt: skip
    assert opened == {"peer_id": "12D3KooWMe", "swarm_id": "friends", "listen_addrs": ["/ip4/10.0.0.2/tcp/4001"],
                      "interfaces": ["eth0"]}  # fmt: skip
    assert shown == []


async def test_mdns_says_why_it_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mdns, "lan_interfaces", lambda: [])
    notices, shown = _notices()
    await serve_mdns(_Service(), _Host(), "friends", notices)  # type: ignore[arg-type]
    assert shown == ["mDNS: no LAN interface with a private IPv4 address; not announcing"]

    @contextlib.asynccontextmanager
    async def refused(**kw: Any) -> AsyncIterator[Any]:
        raise UsageError("port 5353 is taken")
        yield

    monkeypatch.setattr(mdns, "lan_interfaces", lambda: ["eth0"])
    monkeypatch.setattr(mdns, "open_mdns", refused)
    await serve_mdns(_Service(), _Host(), "friends", notices)  # type: ignore[arg-type]
    assert shown[-1] == "mDNS off: port 5353 is taken"
