"""Circuit relay v2, DCUtR and the dial-back check through the real stack on loopback.

Three SwarmHosts in one process (a relay with hop on, two nodes), all with admission, so every
connection here, relayed ones included, is Noise + yamux + the swarm's admission handshake. The
NAT-specific behaviour (hole punching across MASQUERADE routers) is in test_nat_lab.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import typer

from swarm.cli.bootstrap import dialable
from swarm.errors import PeerError, PeerTimeout, UsageError
from swarm.net.dialback import Reachability, dialback_check, serve_dialback
from swarm.net.host import SwarmHost, open_host
from swarm.net.nat import diagnose
from swarm.net.paths import Route, circuit_addr, connection_addrs, parse_peer_addr, path_to
from swarm.net.relay import RelayNode, RelayPolicy, open_relay, open_relay_host

SECRET = os.urandom(32)
SWARM = "fedcba9876543210fedcba9876543210"
LOOP = ["/ip4/127.0.0.1/tcp/0"]
pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def _node(
    *, hop: bool = False, hole_punch: bool = True
) -> AsyncIterator[tuple[SwarmHost, RelayNode]]:
    async with open_host(os.urandom(32), LOOP, secret=SECRET, swarm_id=SWARM) as host, open_relay(
        host.libp2p, hop=hop, hole_punch=hole_punch, admit=host.dial
    ) as relay:  # fmt: skip
        if hop:
            serve_dialback(host.libp2p)
        yield host, relay


async def test_reserve_relayed_dial_admission_and_upgrade() -> None:
    async with _node(hop=True) as (r, _), _node() as (a, ra), _node() as (b, rb):
        relay_addr = r.addrs()[0]
        circuit = await ra.reserve(relay_addr, timeout=10)
        assert circuit == f"{relay_addr}/p2p-circuit/p2p/{a.peer_id}" == ra.circuit_addrs[0]
        assert a.is_admitted(r.peer_id) and r.is_admitted(a.peer_id)

        await rb.reserve(relay_addr, timeout=10)
        got = await rb.dial(circuit, timeout=10)
        assert got == a.peer_id
        # The connection is relayed, and admission ran over it (both directions).
        assert path_to(b.libp2p, a.peer_id) is Route.RELAYED
        assert all("/p2p-circuit" in x for x in connection_addrs(b.libp2p, a.peer_id))
        assert b.is_admitted(a.peer_id)
        with trio.fail_after(5):
            while not a.is_admitted(b.peer_id):
                await trio.sleep(0.05)
        assert await b.libp2p_ping(a.peer_id, timeout=5) > 0

        # On loopback nothing blocks a direct dial: DCUtR upgrades the relayed connection.
        assert await rb.punch(a.peer_id, timeout=20) is True
        assert path_to(b.libp2p, a.peer_id) is Route.DIRECT
        assert rb.path_label(a.peer_id) == "hole-punched"
        assert await b.libp2p_ping(a.peer_id, timeout=5) > 0


async def test_reservations_are_renewed_and_keep_working() -> None:
    async with _node(hop=True) as (r, _), _node() as (a, ra), _node() as (b, rb):
        circuit = await ra.reserve(r.addrs()[0], timeout=10)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: ra.watch(interval=0.05, refresh_s=0.2))
            await trio.sleep(1.0)  # a few renewals
            nursery.cancel_scope.cancel()
        assert ra.circuit_addrs == [circuit]
        assert await rb.dial(circuit, timeout=10) == a.peer_id  # the slot still works


async def test_relay_refusals_are_peer_errors() -> None:
    async with _node(hop=True) as (r, _), _node() as (plain, _), _node() as (b, rb):
        # A node that is not a relay: reserving there fails with a clear reason.
        with pytest.raises(PeerError, match="does not offer circuit relay v2"):
            await rb.reserve(plain.addrs()[0], timeout=10)
        # A peer without a reservation cannot be reached through the relay.
        with pytest.raises(PeerError, match=plain.peer_id):
            await rb.dial(circuit_addr(r.addrs()[0], plain.peer_id), timeout=10)
        # Nothing listens there: a bounded failure, not a hang.
        dead = f"/ip4/127.0.0.1/tcp/9/p2p/{plain.peer_id}"
        with trio.fail_after(15), pytest.raises((PeerError, PeerTimeout)):
            await rb.reserve(dead, timeout=5)


async def test_bad_addresses_and_policies_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="relay address"):
        parse_peer_addr("/ip4/1.2.3.4/tcp/1", what="relay address")
    with pytest.raises(UsageError):
        circuit_addr("not an address", "12D3KooWHT9nGqYx1dwzXkKJLans48kNHALUa6jS28NYm245uyDy")
    with pytest.raises(UsageError, match="positive"):
        RelayPolicy(max_reservations=0).limits()
    async with _node() as (h, _):
        with pytest.raises(UsageError, match="peer ID"):
            path_to(h.libp2p, "0OIl-not-base58")


async def test_dialback_on_loopback_is_public_and_dead_ports_fail() -> None:
    async with _node(hop=True) as (r, _), _node() as (a, ra):
        await a.dial(r.addrs()[0])
        port = int(a.addrs()[0].split("/tcp/")[1].split("/")[0])
        res = await dialback_check(a.libp2p, r.peer_id, ports=[port, 9], timeout=15)
        assert res.reachable_ports == (port,)
        assert [p for p, _ in res.failed] == [9]  # nothing listens on 9: no false "public"
        assert res.observed.startswith("/ip4/127.0.0.1/tcp/")
        # The probe connection was closed; our main connection to the helper survived it.
        assert a.is_admitted(r.peer_id) and path_to(a.libp2p, r.peer_id) is Route.DIRECT
        d = await diagnose(a.libp2p, bootstrap_addrs=[r.addrs()[0]], relay=ra,
                           local_ips=["127.0.0.1"], timeout=10)  # fmt: skip
        assert d.reachability is Reachability.PUBLIC
        assert d.bootstrap[0]["ok"] is True and d.bootstrap[0]["ms"] > 0
        assert d.relay_addrs == []  # public: no reservation needed
        assert any("nothing to do" in line for line in d.lines())


async def test_open_relay_host_without_secret_is_an_open_relay() -> None:
    async with open_relay_host(os.urandom(32), LOOP) as relay_host, open_relay(
        relay_host, hop=True
    ):  # fmt: skip
        addr = f"{relay_host.get_addrs()[0]}"
        async with open_relay_host(os.urandom(32), LOOP) as h, open_relay(h) as rn:
            circuit = await rn.reserve(addr, timeout=10)
            assert circuit.endswith(f"/p2p-circuit/p2p/{h.get_id()}")


def test_dialable_expands_wildcards() -> None:
    table = {"lo": ["127.0.0.1"], "eth0": ["203.0.113.5"], "v6": ["fe80::1"]}
    got = dialable(["/ip4/0.0.0.0/tcp/4001/p2p/X", "/ip6/::/tcp/4001/p2p/X", "/ip4/10.1.1.1/tcp/5/p2p/X"], table)
    # never a wildcard, never loopback beside a real address: a peer elsewhere dialing either
    # reaches its own listener
    assert got == ["/ip4/203.0.113.5/tcp/4001/p2p/X", "/ip4/10.1.1.1/tcp/5/p2p/X"]
    # a machine with nothing but loopback (tests, one-box swarms) keeps it
    assert dialable(["/ip4/0.0.0.0/tcp/7/p2p/X"], {"lo": ["127.0.0.1"]}) == ["/ip4/127.0.0.1/tcp/7/p2p/X"]


def test_bootstrap_command_registers_and_refuses_a_bad_manifest(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from swarm.cli.bootstrap import register
    from swarm.errors import ManifestError

    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None: ...

    out = CliRunner().invoke(app, ["bootstrap", "--help"])
    assert out.exit_code == 0 and "--manifest" in out.output and "--listen" in out.output
    bad = tmp_path / "invite.json"
    bad.write_text('{"version": 1}')
    with pytest.raises(ManifestError) as err:
        app(["bootstrap", "--manifest", str(bad), "--key", str(tmp_path / "k"),
             "--listen", "/ip4/127.0.0.1/tcp/0"], standalone_mode=False)  # fmt: skip
    assert err.value.exit_code == 4 and str(bad) in str(err.value)


def test_id_prints_the_peer_id_then_dialable_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from swarm.cli.bootstrap import register
    from swarm.manifest.identity import load_identity

    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path))
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None: ...

    out = CliRunner().invoke(app, ["id", "--listen", "/ip4/0.0.0.0/tcp/4001", "--listen", "/ip4/10.9.8.7/tcp/5"])
    assert out.exit_code == 0, out.output
    peer, *addrs = out.output.split()
    assert peer == load_identity(tmp_path / "identity.key").peer_id  # the node identity, created once
    assert addrs and all(a.endswith(f"/p2p/{peer}") and "/0.0.0.0/" not in a for a in addrs)
    assert addrs[-1] == f"/ip4/10.9.8.7/tcp/5/p2p/{peer}"
    again = CliRunner().invoke(app, ["id", "--listen", "/ip4/10.9.8.7/tcp/5"])
    assert again.output.split()[0] == peer
    bad = CliRunner().invoke(app, ["id", "--listen", "/ip4/1.2.3.4/udp/5"])
    assert bad.exit_code != 0
