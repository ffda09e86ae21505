"""``shard-swarm bootstrap``: a public node that is a circuit-relay v2 relay and a dial-back helper.

Home nodes connect to it to find each other, reserve a relay slot there when they are behind a
NAT, ask it to dial them back (``join --diagnose``), and use it to coordinate hole punching. With
``--manifest`` it joins that swarm's admission (it proves the swarm secret like any node, and only
admitted peers stay connected); without one it is an open relay for any libp2p peer, which
shard-swarm nodes do not keep (their admission drops peers that cannot prove the secret).
See bootstrap/README.md.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

import trio
import typer

from swarm.cli import ui
from swarm.errors import UsageError

log = logging.getLogger("swarm.cli.bootstrap")

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"


def dialable(addrs: list[str], table: dict[str, list[str]]) -> list[str]:
    """Expand wildcard listen addresses (0.0.0.0) to this machine's IPv4 addresses."""
    out: list[str] = []
    ips = [ip for ips in table.values() for ip in ips if ipaddress.ip_address(ip).version == 4]
    ips.sort(key=lambda ip: ipaddress.ip_address(ip).is_loopback)  # loopback last
    for a in addrs:
        if a.startswith("/ip4/0.0.0.0/"):
            out += [a.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in ips]
        else:
            out.append(a)
    return list(dict.fromkeys(out))


async def serve_bootstrap(
    listen: list[str],
    manifest_path: Path | None,
    key_path: Path | None,
    *,
    ready: trio.Event | None = None,
) -> None:
    """Run the bootstrap node until cancelled; prints its dialable addresses on stdout."""
    from swarm.manifest.identity import default_key_path, load_or_create_identity
    from swarm.manifest.manifest import read_manifest
    from swarm.net.mdns import interface_table
    from swarm.net.nat import serve_dialback
    from swarm.net.relay import open_relay, open_relay_host

    if not logging.getLogger("swarm").isEnabledFor(logging.DEBUG):
        # py-libp2p logs every closed reservation stream and failed probe as an ERROR; the
        # operator reads our own log lines instead (use -v to see the library's).
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    identity = load_or_create_identity(key_path or default_key_path().with_name("bootstrap.key"))
    secret, swarm_id, revoked = None, "", frozenset[str]()
    if manifest_path is not None:
        manifest = read_manifest(manifest_path)
        from swarm.manifest.pins import check_pin

        check_pin(manifest)  # trust on first use, as `join` does
        secret, swarm_id = manifest.secret.value, manifest.swarm_id
        revoked = frozenset(manifest.revoked)
        ui.notice(f"serving swarm {manifest.swarm_name!r} (admission with its secret)")
    else:
        ui.notice("no --manifest: running an open relay; shard-swarm nodes only keep a bootstrap "
                  "node that holds their swarm's invite")  # fmt: skip
    async with open_relay_host(
        identity.seed, listen, secret=secret, swarm_id=swarm_id, revoked=revoked
    ) as host:
        serve_dialback(host)
        async with open_relay(host, hop=True, hole_punch=False):
            addrs = dialable([str(a) for a in host.get_addrs()], interface_table())
            for a in addrs:
                sys.stdout.write(a + "\n")
            sys.stdout.flush()
            ui.notice(f"bootstrap/relay node {identity.peer_id} is up; Ctrl-C stops it")
            if ready is not None:
                ready.set()
            await trio.sleep_forever()


def register(app: typer.Typer) -> None:
    @app.command("bootstrap")
    def bootstrap(
        listen: list[str] = typer.Option(
            [DEFAULT_LISTEN], "--listen", help="Multiaddr to listen on (repeatable)."
        ),
        manifest: Path | None = typer.Option(
            None, "--manifest", help="Invite of the swarm to serve (admission with its secret)."
        ),
        key: Path | None = typer.Option(
            None, "--key", help="Identity key file (default: bootstrap.key in the config dir)."
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
