"""Per-hop transport cost, side by side on loopback: plain trio TCP vs our direct path vs libp2p.

    .venv/bin/python benchmarks/bench_transport.py [--quick] [--procs 1|2]

Three transports carry the same length-prefixed messages:

  (a) plain   trio TCP socket, TCP_NODELAY, 4-byte length prefix, no crypto, no locks or
              deadlines (the floor; it reads with the same recv_into buffer as (b))
  (b) direct  FastChannel over our sealed direct socket (handshake over a real libp2p host)
  (b') direct-chacha  the same with ChaCha20-Poly1305 (peers whose libsodium lacks AEGIS)
  (c) libp2p  FastChannel fallback: the same messages over a py-libp2p Noise + yamux stream
              (open_host from swarm/net/host.py; the path used when no direct socket exists)

For 8 KiB and 64 KiB messages it measures RTT (ping-pong, one message each way; median of many
round trips) and one-way throughput (a burst of messages then a 1-byte ack; median MB/s over
rounds). Rounds of (a), (b), (c) are interleaved so background load hits all three alike.

``--procs 1``: both ends are trio tasks in one process (one core does sender and receiver work,
crypto included). ``--procs 2``: the echo/sink end runs in a child process (what a real hop is).
Writes benchmarks/results/transport.json (medians, ratios b/a and c/a, targets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.net.channel import BufferedReader, SocketReader, write_nowait  # noqa: E402
from swarm.net.fastpath_host import open_fastpath_service  # noqa: E402
from swarm.net.host import open_host  # noqa: E402
from swarm.net.sealing import CIPHERS, Sealer  # noqa: E402

SIZES = (8 * 1024, 64 * 1024)
_LEN = struct.Struct(">I")
SECRET = b"bench-secret-0123456789abcdef"


class Plain:
    """(a): textbook trio: ``SocketStream.send_all`` and ``receive_some`` into a buffer."""

    path = "plain"

    def __init__(self, stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self.stream = stream
        self.reader: Any = BufferedReader(stream, "plain")

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(_LEN.pack(len(data)) + data)

    async def receive(self) -> bytes:
        (n,) = _LEN.unpack(await self.reader.exactly(4))
        return bytes(await self.reader.exactly(n))

    async def aclose(self) -> None:
        await self.stream.aclose()


class PlainTuned(Plain):
    """(a'): the same I/O tricks as (b) (os.write first, recv into one buffer), no crypto,
    no locks, no deadlines: (b)/(a') is the price of sealing, counters and timeouts alone."""

    path = "plain-tuned"

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__(stream)
        self.reader = SocketReader(stream.socket, "plain-tuned")
        self.fd = stream.socket.fileno()

    async def send(self, data: bytes) -> None:
        frame = memoryview(_LEN.pack(len(data)) + data)
        sent = write_nowait(self.fd, frame)
        if sent < len(frame):
            await self.stream.send_all(frame[sent:])


# ------------------------------------------------------------------------- the two ends


async def echo(ch: Any) -> None:
    """Serve RTT ('E' + payload -> payload back) and throughput ('T' count size, then data)."""
    while True:
        try:
            msg = await ch.receive()
        except Exception:
            return
        kind = msg[:1]
        if kind == b"E":
            await ch.send(msg[1:])
        elif kind == b"T":
            count = int.from_bytes(msg[1:9], "big")
            for _ in range(count):
                await ch.receive()
            await ch.send(b"k")
        else:
            return


async def measure_rtt(ch: Any, size: int, iters: int) -> list[float]:
    payload = b"E" + os.urandom(size - 1)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await ch.send(payload)
        await ch.receive()
        out.append(time.perf_counter() - t0)
    return out


async def measure_tput(ch: Any, size: int, count: int) -> float:
    payload = os.urandom(size)
    await ch.send(b"T" + count.to_bytes(8, "big"))
    t0 = time.perf_counter()
    for _ in range(count):
        await ch.send(payload)
    assert await ch.receive() == b"k"
    return size * count / (time.perf_counter() - t0) / 1e6


# ------------------------------------------------------------------------- setting up pairs

Opener = Callable[[], Awaitable[Any]]


async def plain_pair(
    nursery: trio.Nursery, remote: tuple[str, int] | None, cls: type[Plain] = Plain
) -> Any:
    if remote is not None:
        return cls(await trio.open_tcp_stream(*remote))
    (lst,) = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def accept() -> None:
        s = await lst.accept()
        nursery.start_soon(echo, cls(s))

    nursery.start_soon(accept)
    return cls(await trio.open_tcp_stream("127.0.0.1", lst.socket.getsockname()[1]))


async def serve_echoes(fp: Any, nursery: trio.Nursery) -> None:
    async for ch in fp.incoming:
        nursery.start_soon(echo, ch)


# ------------------------------------------------------------------------- child process


async def child_main(port_file: str) -> None:
    """The far end for --procs 2: a plain echo listener and a libp2p host with the fast path."""
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        ports = {}
        for cls in (Plain, PlainTuned):
            (lst,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            ports[cls.path] = lst.socket.getsockname()[1]

            async def accept_plain(lst: Any = lst, cls: type[Plain] = cls) -> None:
                while True:
                    s = await lst.accept()
                    nursery.start_soon(echo, cls(s))

            nursery.start_soon(accept_plain)
        host = await stack.enter_async_context(
            open_host(b"\x02" * 32, secret=SECRET, swarm_id="bench")
        )
        fp_direct = await stack.enter_async_context(open_fastpath_service(host))
        nursery.start_soon(serve_echoes, fp_direct, nursery)
        info = {**ports, "addr": host.addrs()[0]}
        Path(port_file).write_text(json.dumps(info))
        await trio.sleep_forever()


# ------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rtt_iters, rounds = (60, 3) if args.quick else (args.rtt_iters, args.rounds)
    tput_bytes = (4 if args.quick else 8) * 1024 * 1024
    results: dict[str, Any] = {}
    child = None
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        ha = await stack.enter_async_context(
            open_host(b"\x01" * 32, secret=SECRET, swarm_id="bench")
        )
        if args.procs == 2:
            port_file = f"/tmp/bench_transport_{os.getpid()}.json"
            child = subprocess.Popen([sys.executable, __file__, "--child", port_file])
            for _ in range(200):
                if Path(port_file).exists() and Path(port_file).read_text():
                    break
                await trio.sleep(0.05)
            info = json.loads(Path(port_file).read_text())
            os.unlink(port_file)
            peer = await ha.dial(info["addr"])
            fa = await stack.enter_async_context(open_fastpath_service(ha))
            plain = await plain_pair(nursery, ("127.0.0.1", info["plain"]))
            tuned = await plain_pair(nursery, ("127.0.0.1", info["plain-tuned"]), PlainTuned)
            direct = await fa.dial(peer)
            fa.ciphers = ("chacha20-poly1305-ietf",)  # what peers without AEGIS get
            chacha = await fa.dial(peer)
            fa.dial_timeout = 0.0  # forced fallback: give up the direct dial at once
            libp2p = await fa.dial(peer)
        else:
            hb = await stack.enter_async_context(
                open_host(b"\x02" * 32, secret=SECRET, swarm_id="bench")
            )
            fa = await stack.enter_async_context(open_fastpath_service(ha))
            fb = await stack.enter_async_context(open_fastpath_service(hb))
            nursery.start_soon(serve_echoes, fb, nursery)
            peer = await ha.dial(hb.addrs()[0])
            plain = await plain_pair(nursery, None)
            tuned = await plain_pair(nursery, None, PlainTuned)
            direct = await fa.dial(peer)
            fa.ciphers = ("chacha20-poly1305-ietf",)  # what peers without AEGIS get
            chacha = await fa.dial(peer)
            fa.dial_timeout = 0.0  # forced fallback: give up the direct dial at once
            libp2p = await fa.dial(peer)
        assert (direct.path, libp2p.path) == ("direct", "libp2p"), (direct.path, libp2p.path)
        assert chacha.cipher == "chacha20-poly1305-ietf"
        chans = {
            "plain": plain,
            "plain-tuned": tuned,
            "direct": direct,
            "direct-chacha": chacha,
            "libp2p": libp2p,
        }
        for size in SIZES:
            rtts: dict[str, list[float]] = {k: [] for k in chans}
            tputs: dict[str, list[float]] = {k: [] for k in chans}
            for ch in chans.values():  # warm up
                await measure_rtt(ch, size, 20)
            for _ in range(rounds):
                for name, ch in chans.items():
                    # libp2p is ~10-50x slower: fewer samples keep the run short
                    scale = 4 if name == "libp2p" else 1
                    rtts[name] += await measure_rtt(ch, size, rtt_iters // scale)
                for name, ch in chans.items():
                    scale = 8 if name == "libp2p" else 1
                    count = max(8, tput_bytes // scale // size)
                    tputs[name].append(await measure_tput(ch, size, count))
            row: dict[str, Any] = {}
            for name in chans:
                row[name] = {
                    "rtt_ms_median": statistics.median(rtts[name]) * 1e3,
                    "rtt_ms_p90": statistics.quantiles(rtts[name], n=10)[-1] * 1e3,
                    "throughput_MBps_median": statistics.median(tputs[name]),
                    "rtt_samples": len(rtts[name]),
                    "throughput_rounds": len(tputs[name]),
                }
            for name, base in (
                ("direct", "plain"),
                ("libp2p", "plain"),
                ("direct-chacha", "plain"),
                ("direct", "plain-tuned"),
                ("plain-tuned", "plain"),
            ):
                row[f"{name}_vs_{base}"] = {
                    "rtt_ratio": row[name]["rtt_ms_median"] / row[base]["rtt_ms_median"],
                    "throughput_ratio": row[name]["throughput_MBps_median"]
                    / row[base]["throughput_MBps_median"],
                }
            results[f"{size // 1024}KiB"] = row
            print(f"{size // 1024} KiB: " + json.dumps(row), file=sys.stderr)
        results["cipher"] = direct.cipher
        for ch in chans.values():
            await ch.aclose()
        nursery.cancel_scope.cancel()
    if child is not None:
        child.terminate()
        child.wait(5)
    return results


def aead_cost() -> dict[str, Any]:
    """Microseconds to seal and to open one 8 KiB / 64 KiB frame, per cipher (one core)."""
    out: dict[str, Any] = {}
    for cipher in CIPHERS.values():
        sealer = Sealer(cipher, bytes(cipher.key_len))
        nonce, aad = bytes(cipher.nonce_len), bytes(12)
        row = {}
        for size in SIZES:
            plain = os.urandom(size)
            sealed = memoryview(bytearray(size + cipher.tag_len))
            back = memoryview(bytearray(size))
            seal, opn = [], []
            for _ in range(200):
                t0 = time.perf_counter()
                sealer.seal_into(sealed, plain, aad, nonce)
                t1 = time.perf_counter()
                assert sealer.open_into(back, sealed, aad, nonce)
                seal.append(t1 - t0)
                opn.append(time.perf_counter() - t1)
            row[f"{size // 1024}KiB"] = {
                "seal_us_median": statistics.median(seal) * 1e6,
                "open_us_median": statistics.median(opn) * 1e6,
            }
        out[cipher.name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, choices=(1, 2), default=1)
    ap.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    ap.add_argument("--rtt-iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "transport.json"))
    args = ap.parse_args()
    if args.child:
        trio.run(child_main, args.child)
        return
    res = trio.run(run, args)
    k64 = res["64KiB"]["direct_vs_plain"]
    report = {
        "what": "loopback transport cost per hop; medians; ratios are (b)/(a) and (c)/(a)",
        "mode": f"{args.procs} process(es)"
        + (
            ": both ends trio tasks in one process"
            if args.procs == 1
            else ": echo end in a child process"
        ),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "targets_64KiB": {
            "rtt_ratio_max": 2.0,
            "throughput_ratio_min": 0.5,
            "direct_meets_rtt": k64["rtt_ratio"] <= 2.0,
            "direct_meets_throughput": k64["throughput_ratio"] >= 0.5,
        },
        "results": res,
        "aead_cost": aead_cost(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    existing: dict[str, Any] = {}
    if out.exists():
        try:
            existing = json.loads(out.read_text())
        except json.JSONDecodeError:
            existing = {}
    existing[f"procs_{args.procs}"] = report
    out.write_text(json.dumps(existing, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
