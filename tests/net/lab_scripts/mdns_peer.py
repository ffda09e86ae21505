"""A node for the mDNS lab, run inside a namespace by tests/net/test_mdns.py.

Runs a real SwarmHost listening on 0.0.0.0, announces it over mDNS on the one interface it is
told to use, and for every peer of its swarm it finds: dials the announced address (admission
included) and prints ``FOUND <json>``. Other swarms' announcements must never show up.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import trio

from swarm.net.host import open_host
from swarm.net.mdns import open_mdns


def emit(key: str, value: object) -> None:
    sys.stdout.write(f"{key} {json.dumps(value)}\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    async with open_host(
        bytes.fromhex(args.seed), ["/ip4/0.0.0.0/tcp/4001"], secret=bytes.fromhex(args.secret),
        swarm_id=args.swarm_id,
    ) as host:  # fmt: skip
        listen = [a.rsplit("/p2p/", 1)[0] for a in host.addrs()]
        async with open_mdns(
            peer_id=host.peer_id, swarm_id=args.swarm_id, listen_addrs=listen,
            interfaces=[args.interface],
        ) as mdns:  # fmt: skip
            emit("ANNOUNCED", {"addrs": mdns.announced, "zeroconf_interfaces": mdns.interface_ips})
            with trio.move_on_after(args.wait):
                async for found in mdns.discoveries():
                    peer = await host.dial(found.addrs[0], timeout=10)
                    emit("FOUND", {"peer": peer, "addrs": list(found.addrs),
                                   "admitted": host.is_admitted(peer),
                                   "s": time.monotonic() - t0})  # fmt: skip
            emit("DONE", sorted(mdns.found))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", required=True)
    ap.add_argument("--secret", required=True)
    ap.add_argument("--swarm-id", required=True)
    ap.add_argument("--interface", required=True)
    ap.add_argument("--wait", type=float, default=20.0)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(main, ap.parse_args())
