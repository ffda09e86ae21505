"""Fetch throughput from another member, side by side with plain TCP moving the same byte ranges.

    .venv/bin/python benchmarks/bench_fetch_members.py [--gb 0.5] [--rounds 7]
    (also: benchmarks/bench_fetch.py --members ...)

Writes a sharded safetensors checkpoint (bench_fetch.write_model) and starts a **member in its
own process** (this file with ``--serve``, as a real member is another machine's process): a
libp2p host with its fast-path service serving its own copy over /shard-swarm/tensors/1, and a
plain TCP listener that sends the same byte ranges. The fetcher is this process. Each round,
interleaved so background load hits all alike, into an empty cache / file:

  (a) fast    ``fetch_from_members`` of a third of the layers over the fast path (a direct
              AEAD-sealed TCP socket, the ring's data plane), each tensor's sha256 checked,
              written in place into the cache's sparse files
  (a') libp2p the same over /shard-swarm/tensors/1 (py-libp2p: Noise + yamux), the fallback
  (b) tcp     the same ranges (headers included), read by the member process with pread a MiB
              at a time in a worker thread and sent over one plain trio TCP stream, received
              and written to a file by this process, nothing checked

Reports medians of MB/s, ``ratio_members_over_tcp`` = a/b (issue 25's target: >= 0.5),
``ratio_libp2p_over_tcp`` = a'/b, and each end's CPU milliseconds per MB moved (user + system,
all threads: this process's from getrusage, the member's from /proc). Writes
benchmarks/results/fetch_members.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("BENCH_TREE") or Path(__file__).resolve().parents[1])  # --ab's worker: the base tree
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from swarm.fetch.cache import ModelCache, _runs  # noqa: E402
from swarm.fetch.peers import Holdings, Holds  # noqa: E402
from swarm.manifest.model_manifest import ModelManifest, manifest_of_path, parse_model_manifest  # noqa: E402
from swarm.net.fastpath_host import open_fastpath_service  # noqa: E402
from swarm.net.host import open_host  # noqa: E402
from swarm.node.compute.members import fetch_from_members, serve_tensors  # noqa: E402
from swarm.node.ring.fastlink import FrameLink  # noqa: E402
from swarm.proto.messages import parse_message  # noqa: E402

SECRET, SWARM = hashlib.sha256(b"bench").digest(), "0" * 32
LOOP = ("/ip4/127.0.0.1/tcp/0",)
CHUNK = 1 << 20
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fetch_members.json"


def block_ranges(m: ModelManifest, lo: int, hi: int) -> list[tuple[str, int, int]]:
    """What a fetch of layers [lo, hi) moves: every weight header, then the block's merged runs."""
    todo = sorted(m.block(lo, hi), key=lambda x: (x.file, x.start))
    ranges = [(f.path, 0, f.header_end) for f in m.weight_files()]
    return ranges + [(run[0].file, run[0].start, run[-1].end) for run in _runs(todo, {})]


# ---------------------------------------------------------------------------- the member process


async def _serve(work: Path, key: int = 1) -> None:
    model = work / "model"
    m = parse_model_manifest((work / "manifest.json").read_bytes())
    ranges = [tuple(r) for r in json.loads((work / "ranges.json").read_text())]

    async def tcp(stream: trio.SocketStream) -> None:
        for path, s, e in ranges:
            fd = os.open(model / path, os.O_RDONLY)
            try:
                for a in range(s, e, CHUNK):
                    await stream.send_all(await trio.to_thread.run_sync(os.pread, fd, min(CHUNK, e - a), a))
            finally:
                os.close(fd)
        await stream.aclose()

    async with open_host(bytes([key]) * 32, LOOP, secret=SECRET, swarm_id=SWARM) as host, \
            open_fastpath_service(host) as fp, trio.open_nursery() as nursery:  # fmt: skip
        held = Holdings(m, model, m.tensors, m.files)
        served = serve_tensors(host, lambda: held)

        async def one(ch: Any) -> None:  # the node's fast-channel acceptor (wiring.py) in short
            link = FrameLink(ch)
            try:
                await served(link.peer, link, parse_message(await link.receive(timeout=10)))  # type: ignore[arg-type]
            finally:
                await link.close()

        async def accept() -> None:
            async for ch in fp.incoming:
                nursery.start_soon(one, ch)

        nursery.start_soon(accept)
        listeners = await nursery.start(functools.partial(trio.serve_tcp, tcp, 0, host="127.0.0.1"))
        hello = {"peer": host.peer_id, "addr": str(host.addrs()[0]), "tcp": listeners[0].socket.getsockname()[1]}
        print(json.dumps(hello), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the fetcher closes our stdin
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------- the fetcher


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _fetch_member(client: Any, fp: Any, member: str, m: ModelManifest, lo: int, hi: int, root: Path,
                        fast: bool) -> int:  # fmt: skip
    paths: set[str] = set()

    async def dial_fast(peer: str, timeout: float) -> FrameLink:
        link = FrameLink(await fp.dial(peer, timeout=timeout))
        paths.add(link.path)
        return link

    cache = ModelCache(root, m)
    rep = await fetch_from_members(client, cache, m.block(lo, hi), [f.path for f in m.weight_files()],
                                   {member: Holds(frozenset(m.tensors), frozenset(m.files))},
                                   dial_fast=dial_fast if fast else None)  # fmt: skip
    assert cache.holds(m.block(lo, hi)) and not rep.liars and not rep.failed, rep
    assert paths == ({"direct"} if fast else set()), paths
    return rep.fetched


async def _fetch_tcp(port: int, total: int, dest: Path) -> int:
    got = 0
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with open(dest, "wb") as fh:
        while got < total:
            data = await stream.receive_some(CHUNK)
            if not data:
                break
            await trio.to_thread.run_sync(fh.write, data)
            got += len(data)
    await stream.aclose()
    assert got == total, (got, total)
    return got


def _evict(model: Path) -> None:
    """--cold: the member's files out of the page cache (its reads go to the disk)."""
    for p in model.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def _one(path: str, client: Any, fp: Any, proc: subprocess.Popen[str], hello: dict[str, Any], m: ModelManifest,
               lo: int, hi: int, total: int, dest: Path, cold: bool = False) -> tuple[float, float, float]:  # fmt: skip
    """One round of ``path``: (MB/s, fetcher CPU ms per MB, member CPU ms per MB)."""
    if cold:
        _evict(dest.parent / "model")
    c0, s0, t0 = _cpu_self(), _cpu_of(proc.pid), time.perf_counter()
    if path == "tcp":
        n = await _fetch_tcp(hello["tcp"], total, dest)
    else:
        n = await _fetch_member(client, fp, hello["peer"], m, lo, hi, dest, path == "fast")
    dt, c1, s1 = time.perf_counter() - t0, _cpu_self(), _cpu_of(proc.pid)
    mb = n / 1e6
    (shutil.rmtree if dest.is_dir() else Path.unlink)(dest)  # type: ignore[operator]
    return mb / dt, 1e3 * (c1 - c0) / mb, 1e3 * (s1 - s0) / mb


async def _rounds(a: argparse.Namespace, work: Path, m: ModelManifest, lo: int, hi: int, total: int,
                  proc: subprocess.Popen[str], hello: dict[str, Any],
                  base: subprocess.Popen[str] | None = None) -> dict[str, list[tuple[float, float, float]]]:  # fmt: skip
    """Per path: (MB/s, fetcher CPU ms per MB, member CPU ms per MB) of each round; ``base``: a
    worker (--ab) that moves one round of the base tree's fast path at each line it is sent."""
    paths = a.paths.split(",") + (["base"] if base is not None else [])
    out: dict[str, list[tuple[float, float, float]]] = {k: [] for k in ("fast", "libp2p", "tcp", "base")}
    async with open_host(b"\x02" * 32, LOOP, secret=SECRET, swarm_id=SWARM) as client, \
            open_fastpath_service(client) as fp:  # fmt: skip
        await client.dial(hello["addr"])
        for r in range(a.rounds):
            for path in paths if r % 2 == 0 or base is None else paths[::-1]:  # --ab: each side first in turn
                if path == "base":
                    assert base.stdin is not None and base.stdout is not None
                    base.stdin.write("cold\n" if a.cold else "warm\n")
                    base.stdin.flush()
                    got = tuple(json.loads(await trio.to_thread.run_sync(base.stdout.readline)))
                else:
                    got = await _one(path, client, fp, proc, hello, m, lo, hi, total, work / f"{path}{r}", a.cold)
                out[path].append(got)  # type: ignore[arg-type]
            print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.0f} MB/s" for k, v in out.items() if v), file=sys.stderr)
    return out


async def _worker_rounds(work: Path, m: ModelManifest, lo: int, hi: int, total: int, proc: subprocess.Popen[str],
                         hello: dict[str, Any]) -> None:  # fmt: skip
    """--ab's worker (this tree's swarm is BENCH_TREE's): a fast round at each line on stdin."""
    async with open_host(b"\x04" * 32, LOOP, secret=SECRET, swarm_id=SWARM) as client, \
            open_fastpath_service(client) as fp:  # fmt: skip
        await client.dial(hello["addr"])
        print("ready", flush=True)
        r = 0
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            got = await _one("fast", client, fp, proc, hello, m, lo, hi, total, work / f"base{r}", line.strip() == "cold")
            print(json.dumps(got), flush=True)
            r += 1


def _worker(work: Path) -> None:
    m = parse_model_manifest((work / "manifest.json").read_bytes())
    lo, hi, total = json.loads((work / "block.json").read_text())
    proc, hello = _member(work, 3)
    try:
        trio.run(_worker_rounds, work, m, lo, hi, total, proc, hello)
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def _member(work: Path, key: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(work), "--key", str(key)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def _ab(a: argparse.Namespace, got: dict[str, list[tuple[float, float, float]]]) -> dict[str, Any]:
    fast, base, tcp = got["fast"], got["base"], got["tcp"]
    med = statistics.median
    return {
        "ab_base_tree": str(a.ab),
        "base_mb_s": [round(x[0], 1) for x in base],
        "base_mb_s_median": round(med(x[0] for x in base), 1),
        "ratio_base_over_tcp": round(med(x[0] for x in base) / med(x[0] for x in tcp), 3),
        "ratio_base_per_round_median": round(med(x[0] / y[0] for x, y in zip(base, tcp, strict=True)), 3),
        "ratio_ours_over_base_per_round_median": round(med(x[0] / y[0] for x, y in zip(fast, base, strict=True)), 3),
        "cpu_ms_per_mb_median_base": {"fetcher": round(med(x[1] for x in base), 2),
                                      "member": round(med(x[2] for x in base), 2)},  # fmt: skip
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    from bench_fetch import write_model  # the same checkpoint as the origin benchmark

    out = a.out if a.out is not None else DEFAULT_OUT
    work = Path(tempfile.mkdtemp(prefix="bench-fetch-members-"))
    try:
        write_model(work / "model", a.gb, a.layers)
        m = manifest_of_path(work / "model")
        (work / "manifest.json").write_bytes(m.canonical_bytes())
        lo, hi = a.layers // 3, 2 * a.layers // 3
        ranges = block_ranges(m, lo, hi)
        (work / "ranges.json").write_text(json.dumps(ranges))
        total = sum(e - s for _, s, e in ranges)
        (work / "block.json").write_text(json.dumps([lo, hi, total]))
        load0 = os.getloadavg()[0]
        procs = [_member(work, 1)]
        base = None
        try:
            if a.ab is not None:  # the base tree's member and fetcher, in their own processes
                base = subprocess.Popen([sys.executable, __file__, "--worker", str(work)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "BENCH_TREE": str(a.ab.resolve())})  # fmt: skip
                assert base.stdout is not None and base.stdout.readline().strip() == "ready"
            got = trio.run(_rounds, a, work, m, lo, hi, total, *procs[0], base)
        finally:
            for p in [x for x, _ in procs] + ([base] if base is not None else []):
                with contextlib.suppress(OSError):
                    p.stdin.close()  # type: ignore[union-attr]
                p.wait(timeout=30)
        med = {k: statistics.median(x[0] for x in v) if v else float("nan") for k, v in got.items()}
        # fast ÷ tcp only where both paths ran (``--paths fast`` alone has no ratio)
        per_round = [x[0] / y[0] for x, y in zip(got["fast"], got["tcp"], strict=True)] if got["fast"] and got["tcp"] else []
        result = {
            "machine_note": a.note,
            "load_average_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "command": "benchmarks/bench_fetch_members.py " + " ".join(a.argv),
            "machine": platform.machine(),
            "block_layers": [lo, hi],
            "block_bytes": m.block_bytes(lo, hi),
            "bytes_moved_per_round": total,
            "rounds": a.rounds,
            "cold": a.cold,  # the member's files dropped from the page cache before each round
            "members_mb_s": [round(x[0], 1) for x in got["fast"]],
            "members_libp2p_mb_s": [round(x[0], 1) for x in got["libp2p"]],
            "tcp_mb_s": [round(x[0], 1) for x in got["tcp"]],
            "members_mb_s_median": round(med["fast"], 1) if got["fast"] else None,
            "members_libp2p_mb_s_median": round(med["libp2p"], 1) if got["libp2p"] else None,
            "tcp_mb_s_median": round(med["tcp"], 1) if got["tcp"] else None,
            "ratio_members_over_tcp": round(med["fast"] / med["tcp"], 3) if per_round else None,
            "ratio_libp2p_over_tcp": round(med["libp2p"] / med["tcp"], 3) if got["libp2p"] and got["tcp"] else None,
            "ratio_per_round": [round(r, 3) for r in per_round],
            "ratio_per_round_median": round(statistics.median(per_round), 3) if per_round else None,
            "target_ratio": 0.5,
            **(_ab(a, got) if a.ab is not None else {}),
            "cpu_ms_per_mb_median": {k: {"fetcher": round(statistics.median(x[1] for x in v), 2),
                                         "member": round(statistics.median(x[2] for x in v), 2)}
                                     for k, v in got.items() if v and k != "base"},  # fmt: skip
            "what": "fetcher and member in separate processes on loopback. members: fetch_from_members of the "
                    "block from the member over the fast path (a direct AEAD-sealed TCP socket negotiated over "
                    "libp2p), each tensor's sha256 checked, written in place into the cache; members_libp2p: the "
                    "same over /shard-swarm/tensors/1 (py-libp2p, Noise + yamux); tcp: the same ranges, read by "
                    "the member process and sent over one plain trio TCP stream, written to a file by the "
                    "fetcher, nothing checked; rounds interleaved",  # fmt: skip
        }
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="2 shared CPU cores, other engineers running tests at the same time: noisy")
    ap.add_argument("--paths", default="fast,libp2p,tcp",
                    help="which paths each round moves, in order (fast and tcp for the ratio; libp2p is slow)")
    ap.add_argument("--ab", type=Path, default=None, metavar="TREE",
                    help="also move each round over the fast path with TREE's code (a checkout of the base: its "
                         "own member and fetcher processes), alternated with ours; ratio_ours_over_base")
    ap.add_argument("--cold", action="store_true",
                    help="before each round, drop the member's files from the page cache (its reads from the disk)")
    ap.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)  # the member process
    ap.add_argument("--key", type=int, default=1, help=argparse.SUPPRESS)  # the member's key (one byte)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # --ab's base fetcher
    a = ap.parse_args(argv)
    if a.serve is not None:
        trio.run(_serve, a.serve, a.key)
        return
    if a.worker is not None:
        _worker(a.worker)
        return
    a.argv = argv
    run(a)


if __name__ == "__main__":
    main()
