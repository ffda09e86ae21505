"""``shard-swarm bootstrap``: a public node that is a circuit-relay v2 relay and a dial-back helper.

Home nodes connect to it to find each other, reserve a relay slot there when they are behind a
NAT, ask it to dial them back (``join --diagnose``), and use it to coordinate hole punching. With
``--manifest`` it joins that swarm's admission (it proves the swarm secret like any node, and only
admitted peers stay connected); without one it is an open relay for any libp2p peer, which
shard-swarm nodes do not keep (their admission drops peers that cannot prove the secret).
See bootstrap/README.md.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import trio
import typer

from swarm.cli import ui
from swarm.errors import PeerError, SwarmError, UsageError
from swarm.proto.admission import CLIENT, MEMBER
from swarm.proto.limits import PROTO_GEN  # swarm.client's: status and generations

log = logging.getLogger("swarm.cli.bootstrap")

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"
FORWARD_IDLE_S = 600.0  # a forwarded request stream with no frame either way for this long ends


def dialable(addrs: list[str], table: dict[str, list[str]]) -> list[str]:
    """Expand wildcard listen addresses (0.0.0.0) to this machine's IPv4 addresses."""
    from swarm.net.host import dialable_addrs

    return dialable_addrs(addrs, table)


async def _pump(src: Any, dst: Any, done: trio.CancelScope) -> None:
    """Frames from ``src`` to ``dst`` as they came (a relay: it reads no message)."""
    try:
        while True:
            await dst.send(await src.receive(timeout=FORWARD_IDLE_S))
    except SwarmError:
        pass
    finally:
        done.cancel()


async def _forward_requests(service: Any, peer: str, fs: Any) -> None:
    """A client's status / generation request, passed on to a member (any member relays to the
    coordinator): the bootstrap holds no layers, but `status` and `generate` with the invite's
    default peer (this node) still reach the swarm."""
    members = service.members()
    if not members:
        from swarm.proto.control import Fail

        await fs.send_message(Fail("unavailable", "the bootstrap node sees no member of the swarm yet"))
        return
    last: SwarmError | None = None
    for member in members:
        try:
            async with service.host.open_stream(member, PROTO_GEN, timeout=10.0) as up:
                with trio.CancelScope() as done:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_pump, fs, up, done)
                        nursery.start_soon(_pump, up, fs, done)
                return
        except SwarmError as exc:
            last = exc
            log.info("forwarding %s's request to %s failed: %s", peer, member, exc)
    raise PeerError(f"no member took the request: {last}")


async def serve_bootstrap(
    listen: list[str],
    manifest_path: Path | None,
    key_path: Path | None,
    *,
    ready: trio.Event | None = None,
) -> None:
    """Run the bootstrap node until cancelled; prints its dialable addresses on stdout.

    With a manifest it is also the swarm's discovery hub: a member without layers that runs
    membership (heartbeats, and passes every member's signed advert on to the others, so peers
    that only know the bootstrap learn of each other and dial each other, directly or through
    this relay) but never advertises itself, so it is never planned, never the leader, never
    listed as a member; and it passes `status` / `generate` requests on to a member.
    """
    from swarm.manifest.identity import default_key_path, load_or_create_identity
    from swarm.manifest.manifest import read_manifest
    from swarm.net.relay import open_relay_host

    if not logging.getLogger("swarm").isEnabledFor(logging.DEBUG):
        # py-libp2p logs every closed reservation stream and failed probe as an ERROR; the
        # operator reads our own log lines instead (use -v to see the library's).
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    identity = load_or_create_identity(key_path or default_key_path())
    if manifest_path is None:
        ui.notice("no --manifest: running an open relay; shard-swarm nodes only keep a bootstrap "
                  "node that holds their swarm's invite")  # fmt: skip
        async with open_relay_host(identity.seed, listen) as host:
            await _serve_relay(host, identity.peer_id, ready)
        return
    from swarm.net.host import open_host
    from swarm.node.members.gossip import MembershipService
    from swarm.node.members.membership import Membership

    manifest = read_manifest(manifest_path)
    if manifest.role != "member":
        raise UsageError(f"{manifest_path} is a client invite: a bootstrap node needs the member invite")
    from swarm.manifest.pins import check_pin

    check_pin(manifest)  # trust on first use, as `join` does
    revoked = frozenset(manifest.revoked)
    ui.notice(f"serving swarm {manifest.swarm_name!r} (admission with its secret)")
    async with open_host(
        identity.seed, listen, secret=manifest.secret.value, swarm_id=manifest.swarm_id, revoked=revoked
    ) as host:
        membership = Membership(identity, manifest.swarm_id, memory_bytes=0, revoked=revoked)
        service = MembershipService(host, membership, publish=False)
        host.handle(PROTO_GEN, lambda peer, fs: _forward_requests(service, peer, fs), roles=(MEMBER, CLIENT))
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            await _serve_relay(host.libp2p, identity.peer_id, ready)


async def _serve_relay(host: Any, peer_id: str, ready: trio.Event | None) -> None:
    from swarm.net.dialback import serve_dialback
    from swarm.net.mdns import interface_table
    from swarm.net.relay import open_relay

    serve_dialback(host)
    async with open_relay(host, hop=True, hole_punch=False):
        addrs = dialable([str(a) for a in host.get_addrs()], interface_table())
        for a in addrs:
            sys.stdout.write((a if "/p2p/" in a else f"{a}/p2p/{peer_id}") + "\n")
        sys.stdout.flush()
        ui.notice(f"bootstrap/relay node {peer_id} is up; Ctrl-C stops it")
        if ready is not None:
            ready.set()
        await trio.sleep_forever()


def register(app: typer.Typer) -> None:
    @app.command("id")
    def show_id(
        key: Path | None = typer.Option(
            None, "--key", help="Identity key file (default: identity.key in the config dir; created if missing)."
        ),
        listen: list[str] = typer.Option(
            [DEFAULT_LISTEN], "--listen", help="Listen multiaddr the node will use (repeatable)."
        ),
    ) -> None:
        """Print this node's peer ID, then the multiaddrs others can dial it at.

        The first line is the peer ID; each further line a dialable multiaddr ending in
        /p2p/<peer ID> (a wildcard listen address becomes one per interface address): give
        one to `invite create --bootstrap` or to `join --peer`. Behind a NAT these are LAN
        addresses; `join` adds its relay address once it holds a slot.
        """
        from swarm.manifest.identity import default_key_path, load_or_create_identity
        from swarm.net.host import dialable_addrs
        from swarm.net.mdns import interface_table
        from swarm.net.paths import parse_peer_addr

        identity = load_or_create_identity(key or default_key_path())
        for a in listen:
            if "/tcp/" not in a:
                raise UsageError(f"--listen {a!r}: expected a TCP multiaddr like {DEFAULT_LISTEN}")
        lines = [identity.peer_id]
        for a in dialable_addrs(list(listen), interface_table()):
            addr = f"{a}/p2p/{identity.peer_id}"
            parse_peer_addr(addr, what="--listen")
            lines.append(addr)
        sys.stdout.write("\n".join(lines) + "\n")

    @app.command("bootstrap")
    def bootstrap(
        listen: list[str] = typer.Option(
            [DEFAULT_LISTEN], "--listen", help="Multiaddr to listen on (repeatable)."
        ),
        manifest: Path | None = typer.Option(
            None, "--manifest", help="Invite of the swarm to serve (admission with its secret)."
        ),
        key: Path | None = typer.Option(
            None, "--key", help="Identity key file (default: the node identity, identity.key in the config dir)."
        ),
    ) -> None:
        """Run a bootstrap node: a circuit-relay v2 relay and dial-back helper for NATed peers.

        Prints its dialable multiaddrs (put one in invites with --bootstrap) and runs until
        Ctrl-C.
        """
        if not listen:
            raise UsageError("bootstrap needs at least one --listen address")
        try:
            trio.run(serve_bootstrap, list(listen), manifest, key)
        except KeyboardInterrupt:
            ui.notice("bootstrap node stopped")


if __name__ == "__main__":  # `python -m swarm.cli.bootstrap ...`: used by the namespace lab
    from swarm.errors import SwarmError

    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(_app)

    @_app.callback()
    def _root(verbose: bool = typer.Option(False, "-v", "--verbose")) -> None:
        ui.configure(verbose=verbose)

    try:
        _app(args=["bootstrap", *sys.argv[1:]] if sys.argv[1:2] != ["bootstrap"] else sys.argv[1:],
             standalone_mode=False)  # fmt: skip
    except SwarmError as exc:
        ui.error(str(exc))
        sys.exit(exc.exit_code)
