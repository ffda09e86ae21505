"""Outsiders' floods against a real node process: what a peer without the secret can make it hold.

Before this was bounded, an outsider pushed 768 MiB into one identify stream in 3 s and the node's
RSS grew from 93 to 869 MiB (py-libp2p 0.8.1 only warns when a peer sends past a yamux receive
window), and parallel identities multiplied it. Here many identities attack node 0 of the shared
swarm at once, each in the way that makes it hold the most: every stream an unadmitted connection
may open, each filled to its window (held until the node drops the connection), plus identities
that flood past the window as the original attack did and reconnect under a new identity. Node 0's
RSS is sampled throughout; its growth must stay under RSS_GROWTH_CAP, and the swarm keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, TYPE_DATA, YAMUX_HEADER_FORMAT

from swarm.net.libp2p_host import build_libp2p_host
from swarm.net.libp2p_patches import PRE_ADMISSION_STREAMS

from .swarmkit import LiveSwarm, assert_still_serving

pytestmark = pytest.mark.slow

RSS_GROWTH_CAP = 64 << 20  # the bound stated by this test: 16 waiting connections x 8 streams x 256 KiB = 32 MiB, plus overhead
HOLDERS = 48  # identities that fill every window they may open: 48 x 6 x 252 KiB = 71 MiB offered, over the cap
STREAMS = PRE_ADMISSION_STREAMS - 2  # the attacker's own py-libp2p opens identify (and ping) too
FLOODERS = 4  # identities that push past the window, reconnecting under a new identity each time
ATTACK_S = 8.0
LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _frame(stream_id: int, payload: bytes) -> bytes:
    return struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, len(payload)) + payload


async def _attack_once(addr: str, target: str, *, past_window: bool, stop: trio.Event, seen: set[str]) -> int:
    """One identity: connect, open streams, then either fill every window it may open and hold
    them, or push past one window without end. Returns the bytes it sent."""
    raw = build_libp2p_host(os.urandom(32), [LISTEN])
    sent = 0
    chunk = b"\0" * (63 << 10)  # 4 of them fit a 256 KiB window
    async with raw.run([LISTEN]):
        try:
            with trio.move_on_after(ATTACK_S), contextlib.suppress(Exception):
                await raw.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                seen.add(str(raw.get_id()))
                streams = [
                    await raw.new_stream(ID.from_base58(target), [TProtocol(str(IDENTIFY_PROTOCOL))])
                    for _ in range(1 if past_window else STREAMS)
                ]
                for st in streams:
                    frames = 0
                    while (past_window or frames * len(chunk) + len(chunk) <= DEFAULT_WINDOW_SIZE) and not stop.is_set():
                        await st.muxed_conn._write_frame(_frame(st.muxed_stream.stream_id, chunk))
                        sent += len(chunk)
                        frames += 1
                await stop.wait()  # hold the filled windows until the node drops us
        finally:
            with trio.move_on_after(2):
                await raw.close()
    return sent


async def test_an_outsiders_identify_flood_is_bounded_across_identities(live: LiveSwarm) -> None:
    sw = live.swarm
    pid, addr, target = sw.procs[0].pid, sw.addrs[0], sw.peer_ids[0]
    before = _rss(pid)
    peak = before
    pushed = 0
    stop = trio.Event()
    seen: set[str] = set()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss(pid))
            await trio.sleep(0.05)

    async def holder() -> None:
        nonlocal pushed
        pushed += await _attack_once(addr, target, past_window=False, stop=stop, seen=seen)

    async def flooder() -> None:
        nonlocal pushed
        while not stop.is_set():  # a new identity each time the node drops the last one
            pushed += await _attack_once(addr, target, past_window=True, stop=stop, seen=seen)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for _ in range(HOLDERS):
            nursery.start_soon(holder)
        for _ in range(FLOODERS):
            nursery.start_soon(flooder)
        await trio.sleep(ATTACK_S)
        stop.set()
    growth = peak - before
    print(f"node 0 RSS {before >> 20} MiB -> peak {peak >> 20} MiB (+{growth / 2**20:.1f} MiB) "
          f"while {len(seen)} outsider identities sent {pushed / 2**20:.0f} MiB")  # fmt: skip
    assert len(seen) > HOLDERS, f"only {len(seen)} identities connected: the attack did not run"
    assert growth < RSS_GROWTH_CAP, f"node 0 grew {growth / 2**20:.1f} MiB under the flood (cap {RSS_GROWTH_CAP >> 20} MiB)"
    log = sw.log(0)
    assert "past the receive window" in log or "wider than any window" in log  # the flood was met
    assert "were waiting for admission" in log  # so were the parallel identities
    await assert_still_serving(live)
