"""A bootstrap-like relay in its own process for tests/net/test_relay_slots.py: a SwarmHost with
the swarm secret and a circuit-relay hop with a small policy. Prints ``ADDR <multiaddr>``, then
runs until killed."""

from __future__ import annotations

import argparse
import os
import sys

import trio

from swarm.net.host import open_host
from swarm.net.relay import RelayPolicy, open_relay


async def main(secret: bytes, swarm_id: str, slots: int, per_ip: int) -> None:
    policy = RelayPolicy(max_reservations=slots, max_reservations_per_ip=per_ip)
    async with open_host(os.urandom(32), secret=secret, swarm_id=swarm_id) as host, open_relay(
        host.libp2p, hop=True, hole_punch=False, policy=policy, admit=host.dial
    ):  # fmt: skip
        sys.stdout.write(f"ADDR {host.addrs()[0]}\n")
        sys.stdout.flush()
        await trio.sleep_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("secret")
    ap.add_argument("swarm_id")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--per-ip", type=int, default=8)
    a = ap.parse_args()
    trio.run(main, bytes.fromhex(a.secret), a.swarm_id, a.slots, a.per_ip)
