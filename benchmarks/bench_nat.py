"""A relayed hop and a hole-punched hop against a direct one: RTT and one-way throughput.

Run as root (network namespaces): ``PYTHONPATH=. .venv/bin/python benchmarks/bench_nat.py``.
One NAT lab (swarm.testing.netlab: a bootstrap/relay on the "internet", two homes behind
MASQUERADE routers, one public host), side by side in one run:

- direct: the public host dials a server beside the relay (no NAT, no relay);
- relayed: home1 dials home0 at its circuit address with hole punching off on both ends
  (what a symmetric NAT leaves);
- hole-punched: the same two homes with DCUtR on, measured once the direct connection exists.

Each is a real SwarmHost (Noise, yamux, admission) in its own process: RTT is the median of
libp2p pings, throughput the median of 8 MiB writes on one stream acknowledged by the receiver.
Results (medians, ratios to direct) go to benchmarks/results/nat.json. The lab has no link
delay: the numbers are the relay's and the NATs' own cost on this machine, not a WAN's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROTO = "/shard-swarm/bench-sink/1"
BLOB = 8 << 20
CHUNK = 64 << 10


async def _peer(args: argparse.Namespace) -> None:
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from swarm.net.host import open_host
    from swarm.net.relay import open_relay

    def emit(key: str, value: object) -> None:
        sys.stdout.write(f"{key} {json.dumps(value)}\n")
        sys.stdout.flush()

    async with (
        open_host(bytes.fromhex(args.seed), [args.listen], secret=bytes.fromhex(args.secret),
                  swarm_id=args.swarm_id) as host,
        open_relay(host.libp2p, admit=host.dial, hole_punch=args.punch) as relay,
    ):  # fmt: skip
        host.attach_relay(relay)

        async def sink(stream: object) -> None:
            got = 0
            while got < BLOB:
                data = await stream.read(1 << 20)  # type: ignore[attr-defined]
                if not data:
                    return
                got += len(data)
            await stream.write(b"k")  # type: ignore[attr-defined]
            await stream.close()  # type: ignore[attr-defined]

        host.libp2p.set_stream_handler(TProtocol(PROTO), sink)
        if args.relay:
            end = trio.current_time() + 30
            while True:
                try:
                    await relay.reserve(args.relay, timeout=5)
                    break
                except Exception:
                    if trio.current_time() > end:
                        raise
                    await trio.sleep(0.3)
        emit("READY", host.peer_id)
        if not args.dial:
            await trio.sleep(args.linger)
            return
        end = trio.current_time() + 30
        while True:
            try:
                peer = await host.dial(args.dial, timeout=5)
                break
            except Exception:
                if trio.current_time() > end:
                    raise
                await trio.sleep(0.3)
        if args.punch:
            await relay.wait_direct(peer, timeout=40)
        label = host.path_label(peer)
        await host.libp2p_ping(peer, timeout=5)
        rtts = [await host.libp2p_ping(peer, timeout=5) for _ in range(args.pings)]
        rates = []
        chunk = os.urandom(CHUNK)
        for _ in range(args.blobs):
            stream = await host.libp2p.new_stream(ID.from_base58(peer), [TProtocol(PROTO)])
            t0 = time.perf_counter()
            for _ in range(BLOB // CHUNK):
                await stream.write(chunk)
            ack = await stream.read(1)
            dt = time.perf_counter() - t0
            assert ack == b"k", ack
            await stream.close()
            rates.append(BLOB / dt / 1e6)
        emit("RESULT", {"path": label, "rtt_ms": [round(r * 1e3, 3) for r in rtts],
                        "mb_per_s": [round(r, 2) for r in rates]})  # fmt: skip


def _lab(args: argparse.Namespace) -> dict[str, object]:
    from swarm.manifest.identity import Identity, save_identity
    from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
    from swarm.testing.netlab import nat_lab

    issuer = Identity.generate()
    m = sign_manifest(new_manifest(swarm_name="bench", issuer=issuer.public_key), issuer)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    py = [sys.executable, str(Path(__file__).resolve()), "--peer-mode", "--secret", m.secret.value.hex(),
          "--swarm-id", m.swarm_id, "--pings", str(args.pings), "--blobs", str(args.blobs)]  # fmt: skip
    out: dict[str, object] = {}
    with nat_lab(public=1) as lab:
        relay_ns = lab["relay"]
        work = Path(tempfile.mkdtemp(prefix="bench_nat"))
        invite, key = work / "invite.json", work / "boot.key"
        write_manifest(m, invite)
        boot_identity = Identity.generate()
        save_identity(boot_identity, key)
        relay_id = boot_identity.peer_id
        boot = relay_ns.spawn([sys.executable, "-m", "swarm.cli.main", "bootstrap", "--manifest", str(invite),
                               "--key", str(key), "--listen", "/ip4/0.0.0.0/tcp/4001"],
                              env={**env, "SHARD_SWARM_CONFIG": str(work)})  # fmt: skip
        relay_addr = f"/ip4/{relay_ns.addr}/tcp/4001/p2p/{relay_id}"
        boot.wait_for_line(relay_addr, timeout=60)

        def pair(name: str, server_ns: str, client_ns: str, *, via_relay: bool, punch: bool, port: int) -> None:
            s_seed, c_seed = os.urandom(32), os.urandom(32)
            s_id = Identity(s_seed).peer_id
            flags = ["--punch"] if punch else []
            rflag = ["--relay", relay_addr] if via_relay else []
            srv = lab[server_ns].spawn([*py, "--seed", s_seed.hex(), "--listen", f"/ip4/0.0.0.0/tcp/{port}",
                                        *rflag, *flags, "--linger", "300"], env=env)  # fmt: skip
            srv.wait_for_line("READY", timeout=60)
            target = (f"{relay_addr}/p2p-circuit/p2p/{s_id}" if via_relay
                      else f"/ip4/{lab[server_ns].addr}/tcp/{port}/p2p/{s_id}")  # fmt: skip
            cli = lab[client_ns].spawn([*py, "--seed", c_seed.hex(), "--listen", f"/ip4/0.0.0.0/tcp/{port + 1}",
                                        *rflag, *flags, "--dial", target], env=env)  # fmt: skip
            res = json.loads(cli.wait_for_line("RESULT", timeout=300))
            res["rtt_ms_median"] = statistics.median(res["rtt_ms"])
            res["mb_per_s_median"] = statistics.median(res["mb_per_s"])
            out[name] = res
            print(f"{name:>13}: path {res['path']}, RTT {res['rtt_ms_median']:.2f} ms, "
                  f"{res['mb_per_s_median']:.1f} MB/s", flush=True)  # fmt: skip
            cli.kill()
            srv.kill()

        pair("direct", "relay", "public0", via_relay=False, punch=False, port=4301)
        pair("relayed", "home0", "home1", via_relay=True, punch=False, port=4401)
        pair("hole_punched", "home0", "home1", via_relay=True, punch=True, port=4501)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", default="")
    ap.add_argument("--secret", default="")
    ap.add_argument("--swarm-id", default="")
    ap.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    ap.add_argument("--relay", default="")
    ap.add_argument("--dial", default="")
    ap.add_argument("--punch", action="store_true")
    ap.add_argument("--linger", type=float, default=0.0)
    ap.add_argument("--pings", type=int, default=40)
    ap.add_argument("--blobs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nat.json")
    args = ap.parse_args()
    if args.peer_mode:
        import trio

        trio.run(_peer, args)
        return
    res = _lab(args)
    d = res["direct"]
    for k in ("relayed", "hole_punched"):
        r = res[k]
        r["rtt_vs_direct"] = round(r["rtt_ms_median"] / d["rtt_ms_median"], 2)  # type: ignore[index]
        r["throughput_vs_direct"] = round(r["mb_per_s_median"] / d["mb_per_s_median"], 2)  # type: ignore[index]
        print(f"{k}: RTT x{r['rtt_vs_direct']} of direct, throughput x{r['throughput_vs_direct']}")
    res["machine"] = {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0], "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
