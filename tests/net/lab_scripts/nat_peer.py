"""A shard-swarm node for the NAT lab, run inside a namespace by tests/net/test_nat_lab.py.

It runs the real stack: SwarmHost (Noise, yamux, admission) + circuit relay + DCUtR + dial-back.
Every result is one stdout line ``KEY <json>``; the test waits for them with deadlines.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from swarm.errors import SwarmError
from swarm.net.dialback import serve_dialback
from swarm.net.host import open_host
from swarm.net.nat import diagnose
from swarm.net.paths import connection_addrs, path_to
from swarm.net.relay import open_relay

T = TypeVar("T")


def emit(key: str, value: object) -> None:
    sys.stdout.write(f"{key} {json.dumps(value)}\n")
    sys.stdout.flush()


async def retry(op: Callable[[], Awaitable[T]], what: str, deadline: float = 30.0) -> T:
    """Retry ``op`` until it succeeds (processes start in parallel: the relay may not be up)."""
    end = trio.current_time() + deadline
    while True:
        try:
            return await op()
        except SwarmError as exc:
            if trio.current_time() > end:
                raise
            logging.getLogger("lab").info("%s failed, retrying: %s", what, exc)
            await trio.sleep(0.3)


async def main(args: argparse.Namespace) -> None:
    async with open_host(
        bytes.fromhex(args.seed), [args.listen], secret=bytes.fromhex(args.secret),
        swarm_id=args.swarm_id,
    ) as host, open_relay(host.libp2p, admit=host.dial) as relay:  # fmt: skip
        serve_dialback(host.libp2p)
        emit("PEER", host.peer_id)
        t0 = time.monotonic()
        circuit = await retry(lambda: relay.reserve(args.relay, timeout=5), "reserving")
        emit("RESERVED", {"circuit": circuit, "s": time.monotonic() - t0,
                          "relay_admitted": host.is_admitted(args.relay.rsplit("/", 1)[1])})  # fmt: skip
        if args.diagnose:
            d = await diagnose(host.libp2p, bootstrap_addrs=[args.relay], relay=relay,
                               local_ips=[args.local_ip], timeout=8)  # fmt: skip
            emit("DIAGNOSIS", d.to_dict())
        if args.dial:
            t0 = time.monotonic()
            # The other home may not hold its reservation yet: the relay refuses until it does.
            peer = await retry(lambda: relay.dial(args.dial, timeout=5), "dialing")
            # Path and addresses right away: DCUtR's auto-drive (every 2 s) may upgrade soon.
            path, addrs = path_to(host.libp2p, peer).value, connection_addrs(host.libp2p, peer)
            emit("RELAYED", {"peer": peer, "path": path, "addrs": addrs,
                             "admitted": host.is_admitted(peer), "s": time.monotonic() - t0,
                             "rtt_ms": 1000 * await host.libp2p_ping(peer, timeout=5)})  # fmt: skip
            t0 = time.monotonic()
            ok = await relay.punch(peer, timeout=args.punch_timeout)
            direct = [a for a in connection_addrs(host.libp2p, peer) if "/p2p-circuit" not in a]
            emit("PUNCH", {"ok": ok, "s": time.monotonic() - t0,
                           "path": path_to(host.libp2p, peer).value, "direct_addrs": direct,
                           "rtt_ms": 1000 * await host.libp2p_ping(peer, timeout=5)})  # fmt: skip
            d = await diagnose(host.libp2p, bootstrap_addrs=[args.relay], relay=relay,
                               local_ips=[args.local_ip], peers=[peer], timeout=8)  # fmt: skip
            emit("PEERS", d.peers)
        else:
            # The dialed side: report when the other side shows up and how.
            with trio.move_on_after(args.wait):
                while not host.admitted_peers() or len(host.admitted_peers()) < 2:
                    await trio.sleep(0.1)
                others = [p for p in host.admitted_peers() if p not in args.relay]
                emit("INBOUND", {"peer": others[0], "path": path_to(host.libp2p, others[0]).value})
                await relay.wait_direct(others[0], timeout=args.wait)
                emit("INBOUND_DIRECT", {"addrs": connection_addrs(host.libp2p, others[0]),
                                        "label": relay.path_label(others[0])})  # fmt: skip
        emit("DONE", True)
        await trio.sleep(args.linger)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", required=True)
    ap.add_argument("--secret", required=True)
    ap.add_argument("--swarm-id", required=True)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--relay", required=True)
    ap.add_argument("--local-ip", required=True)
    ap.add_argument("--dial")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--punch-timeout", type=float, default=25.0)
    ap.add_argument("--wait", type=float, default=40.0)
    ap.add_argument("--linger", type=float, default=30.0)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(main, ap.parse_args())
