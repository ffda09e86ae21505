"""Soak: a local swarm serves generations non-stop while peers are killed and restarted.

What it measures, in one run:

- correctness: every generation that completes is compared with the in-process reference
  (``swarm.model.generate`` on the same checkpoint and prompt); mismatches are counted and kept;
  generations that fail (a ring member died mid-generation, the swarm re-planning) are counted
  with their error, since replaying a dead peer's work is the recovery issue's job, not this one;
- resources: every ``--sample-s`` seconds, RSS and open file descriptors of every live node
  process (``/proc/PID/status``, ``/proc/PID/fd``) and of this client process; for processes that
  lived through the whole run, growth = median of the last fifth of samples - median of the first
  fifth;
- churn: every ``--churn-s`` seconds one node other than node 0 (the bootstrap, which the client
  talks to) is killed (SIGKILL and SIGTERM alternately), left down ``--down-s`` seconds, and
  restarted with the same identity and port.

Every node offers memory for about half of the model, so any two nodes can form a ring and the
swarm can re-plan around a dead one. The default run is short (1 minute); the issue's soak is
``--minutes 10``. Results: JSON to benchmarks/results/soak.json (or ``--out``).

    .venv/bin/python benchmarks/bench_soak.py                 # quick
    .venv/bin/python benchmarks/bench_soak.py --minutes 10    # the issue's soak
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from swarm import client
from swarm.errors import SwarmError
from swarm.launch import LocalSwarm, start_local_swarm
from swarm.model.config import ModelArgs
from swarm.model.generate import LocalModel, generate
from swarm.node.settings import model_spec
from swarm.testing.checkpoints import TinySpec, write_checkpoint

RESULTS = Path(__file__).parent / "results" / "soak.json"
EXIT_WAIT_S = (
    15.0  # a node that has not exited this long after SIGTERM is recorded as hung, then killed
)
PROMPTS = [
    [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [200, 13, 77, 13, 77, 13, 150],
    [9, 9, 9, 31, 64, 128, 4, 44, 81],
]


def proc_stats(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open fds) of a live process, None if it is gone."""
    try:
        rss_kb = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
        return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None


@dataclass
class Series:
    name: str
    pid: int
    started: float
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, rss MiB, fds)
    ended: float | None = None

    def summary(self, run_start: float, run_end: float) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "pid": self.pid, "samples": len(self.samples),
                               "from_s": round(self.started - run_start, 1),
                               "to_s": round((self.ended or run_end) - run_start, 1)}  # fmt: skip
        if not self.samples:
            return out
        rss = [s[1] for s in self.samples]
        fds = [s[2] for s in self.samples]
        k = max(1, len(self.samples) // 5)
        out.update(
            rss_mib_first=round(statistics.median(rss[:k]), 1), rss_mib_last=round(statistics.median(rss[-k:]), 1),
            rss_mib_max=round(max(rss), 1), fds_first=statistics.median(fds[:k]), fds_last=statistics.median(fds[-k:]),
            fds_max=max(fds),
        )  # fmt: skip
        out["rss_growth_mib"] = round(out["rss_mib_last"] - out["rss_mib_first"], 1)
        out["fd_growth"] = out["fds_last"] - out["fds_first"]
        out["whole_run"] = (
            self.ended is None and self.started <= run_start
        )  # alive from start to end
        return out


@dataclass
class Soak:
    swarm: LocalSwarm
    references: dict[tuple[int, ...], list[int]]
    max_new: int
    series: dict[str, Series] = field(default_factory=dict)
    gens: list[dict[str, Any]] = field(default_factory=list)
    churn: list[dict[str, Any]] = field(default_factory=list)
    incarnation: Counter[int] = field(default_factory=Counter)

    def track(self, i: int) -> None:
        name = f"node{i}#{self.incarnation[i]}"
        self.series[name] = Series(name, self.swarm.procs[i].pid, time.time())

    def restart(self, i: int) -> None:
        """Start node ``i`` again from its settings file: same seed, same port."""
        sw = self.swarm
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(sw.workdir / f"node{i}.log", "ab") as log:  # the child keeps its own copy
            sw.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "swarm.node", str(sw.workdir / f"node{i}.json")],
                stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True,
            )  # fmt: skip
        self.incarnation[i] += 1
        self.track(i)

    def sample(self) -> None:
        now = time.time()
        for s in self.series.values():
            if s.ended is not None:
                continue
            st = proc_stats(s.pid)
            if st is None:
                s.ended = now
            else:
                s.samples.append((now, *st))


async def generation_loop(soak: Soak, stop_at: float) -> None:
    sw = soak.swarm
    rng = random.Random(1)
    while time.time() < stop_at:
        try:
            async with client.open_client(
                sw.addrs[0], secret=sw.secret, swarm_id=sw.swarm_id, timeout=30
            ) as (h, peer):
                while time.time() < stop_at:
                    prompt = rng.choice(PROMPTS)
                    t0 = time.time()
                    rec: dict[str, Any] = {"t": t0, "prompt": PROMPTS.index(prompt)}
                    try:
                        got = await client.generate(h, peer, prompt_ids=prompt, max_new_tokens=soak.max_new,
                                                    wait_s=15.0, timeout=40)  # fmt: skip
                        out = got["output_token_ids"]
                        rec.update(status="ok" if out == soak.references[tuple(prompt)] else "mismatch",
                                   tokens=len(out), seconds=time.time() - t0, tokens_per_s=got.get("tokens_per_s"),
                                   epoch=got.get("epoch"))  # fmt: skip
                        if rec["status"] == "mismatch":
                            rec["got"] = out
                    except SwarmError as exc:
                        rec.update(
                            status="failed",
                            error=f"{type(exc).__name__}: {exc}"[:300],
                            seconds=time.time() - t0,
                        )
                    soak.gens.append(rec)
        except SwarmError as exc:  # the client's own connection broke: reconnect
            soak.gens.append(
                {"t": time.time(), "status": "client_reconnect", "error": str(exc)[:300]}
            )
            await trio.sleep(1.0)


async def churn_loop(soak: Soak, stop_at: float, churn_s: float, down_s: float, seed: int) -> None:
    rng = random.Random(seed)
    n = len(soak.swarm.procs)
    k = 0
    while time.time() + churn_s < stop_at:
        await trio.sleep(churn_s)
        if n < 2:
            return
        i = rng.randrange(1, n)
        sig = signal.SIGKILL if k % 2 == 0 else signal.SIGTERM
        k += 1
        soak.swarm.kill(i, sig)
        soak.churn.append({"t": time.time(), "node": i, "signal": sig.name})
        if not await trio.to_thread.run_sync(_exited, soak.swarm.procs[i], EXIT_WAIT_S):
            soak.churn.append(
                {"t": time.time(), "node": i, "hung_after": sig.name, "then": "SIGKILL"}
            )
            soak.swarm.kill(i, signal.SIGKILL)
            await trio.to_thread.run_sync(_exited, soak.swarm.procs[i], EXIT_WAIT_S)
        soak.sample()
        await trio.sleep(down_s)
        soak.restart(i)
        soak.churn.append({"t": time.time(), "node": i, "restarted": True})


def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


async def sample_loop(soak: Soak, stop_at: float, every: float) -> None:
    while time.time() < stop_at:
        soak.sample()
        await trio.sleep(every)


async def run(
    soak: Soak, minutes: float, churn_s: float, down_s: float, sample_s: float, seed: int
) -> float:
    sw = soak.swarm
    async with client.open_client(sw.addrs[0], secret=sw.secret, swarm_id=sw.swarm_id) as (h, peer):
        await client.wait_ready(h, peer, timeout=180)
    start = time.time()
    stop_at = start + minutes * 60
    soak.series["client"] = Series("client", os.getpid(), start)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_loop, soak, stop_at, sample_s)
        nursery.start_soon(churn_loop, soak, stop_at, churn_s, down_s, seed)
        nursery.start_soon(generation_loop, soak, stop_at)
    return start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--churn-s", type=float, default=20.0, help="seconds between kills")
    ap.add_argument("--down-s", type=float, default=3.0, help="seconds a killed node stays down")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    ckpt = write_checkpoint(tmp / "ckpt", TinySpec(n_layers=a.layers, row_gain_spread=1.0), seed=3)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32)
    refs = {tuple(p): generate(model, p, eos_token_ids=(), max_new_tokens=a.max_new_tokens).output_token_ids
            for p in PROMPTS}  # fmt: skip
    args = ModelArgs.from_dir(ckpt)
    spec = model_spec(args, torch.float32, 1024)
    # about half the model each: any two nodes form a ring, so the swarm can re-plan around a death
    per = int((math.ceil(args.n_layers / 2) * spec.bytes_per_layer + spec.coordinator_bytes) * 1.05)
    t_setup = time.time()
    with start_local_swarm(a.nodes, ckpt, dtype="fp32", memory_bytes=[per] * a.nodes, chunk_timeout=10.0,
                           workdir=tmp / "swarm") as sw:  # fmt: skip
        soak = Soak(sw, refs, a.max_new_tokens)
        for i in range(a.nodes):
            soak.track(i)
        try:
            start = trio.run(run, soak, a.minutes, a.churn_s, a.down_s, a.sample_s, a.seed)
        finally:
            end = time.time()
            tails = {f"node{i}": sw.log(i)[-1500:] for i in range(a.nodes)}
    report(a, soak, t_setup, start, end, tails)
    return 0


def report(
    a: argparse.Namespace,
    soak: Soak,
    t_setup: float,
    start: float,
    end: float,
    tails: dict[str, str],
) -> None:
    gens = [g for g in soak.gens if g["status"] != "client_reconnect"]
    status = Counter(g["status"] for g in soak.gens)
    errors = Counter(str(g.get("error", ""))[:120] for g in gens if g["status"] == "failed")
    ok = [g for g in gens if g["status"] == "ok"]
    series = [s.summary(start, end) for s in soak.series.values()]
    whole = [s for s in series if s.get("whole_run") and s.get("samples", 0) >= 5]
    result = {
        "bench": "soak",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "setup_s": round(start - t_setup, 1),
        "duration_s": round(end - start, 1),
        "generations": dict(status),
        "completed_correct": len(ok),
        "mismatches": [g for g in gens if g["status"] == "mismatch"],
        "all_completed_outputs_correct": status.get("mismatch", 0) == 0,
        "failure_reasons": dict(errors.most_common(10)),
        "median_tokens_per_s": statistics.median(
            [g["tokens_per_s"] for g in ok if g.get("tokens_per_s")] or [0.0]
        ),
        "kills": sum(1 for c in soak.churn if "signal" in c),
        "restarts": sum(1 for c in soak.churn if c.get("restarted")),
        "hung_after_sigterm": sum(1 for c in soak.churn if "hung_after" in c),
        "churn": [{**c, "t": round(c["t"] - start, 1)} for c in soak.churn],
        "processes": series,
        "whole_run_max_rss_growth_mib": max((s["rss_growth_mib"] for s in whole), default=None),
        "whole_run_max_fd_growth": max((s["fd_growth"] for s in whole), default=None),
        "log_tails": tails,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    brief = {k: result[k] for k in ("duration_s", "generations", "all_completed_outputs_correct", "kills",
                                    "restarts", "hung_after_sigterm", "median_tokens_per_s", "whole_run_max_rss_growth_mib",
                                    "whole_run_max_fd_growth")}  # fmt: skip
    print(json.dumps(brief, indent=2))
    for s in whole:
        print(
            f"{s['name']:>10}: RSS {s['rss_mib_first']} -> {s['rss_mib_last']} MiB, fds {s['fds_first']} -> {s['fds_last']}"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
