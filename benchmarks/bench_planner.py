"""Planner benchmark: optimality, heuristic quality, planning time, and churn stickiness.

    .venv/bin/python benchmarks/bench_planner.py [--quick]

Writes benchmarks/results/planner.json. Figures (medians unless said otherwise):

* exact_ratio[n]: plan() traversal / brute-force optimum on random instances of n peers. The brute
  force here is written independently of swarm/planner: every coordinator, every subset, every
  ring order (all permutations) and a separately written greedy layer split (the compute term is
  linear in the layer counts, so filling the fastest peers first is optimal).
* heuristic_small_ratio[n]: the heuristic alone (exact_limit=0) against the same optimum.
* restart_ratio_50: plan() at 50 peers / the best of many random restarts (random feasible rings
  over all 50 peers, each improved by the same local search) -- below 1 means plan() won.
* plan_seconds[n]: wall time of plan() at 100 and 1,000 peers (RTT matrix built beforehand).
* moved_ratio: layers moved after one random ring peer is lost / layers that peer held.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.errors import PlanningError  # noqa: E402
from swarm.planner import GB, Latency, ModelSpec, Peer, plan  # noqa: E402
from swarm.planner.alloc import Ctx  # noqa: E402
from swarm.planner.search import evaluate, local_search  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "planner.json"


def instance(rng: random.Random, n: int, n_layers: int = 48) -> tuple[ModelSpec, list[Peer], dict]:
    """Peers scattered over a 4,000 km square; RTT ~ distance, asymmetric noise, 5 % pairs missing."""
    spec = ModelSpec(
        n_layers=n_layers,
        layer_bytes=GB // 2,
        kv_bytes_per_token_per_layer=8192,
        coordinator_bytes=GB,
        context_tokens=8192,
    )
    pts = [(rng.uniform(0, 4000), rng.uniform(0, 4000)) for _ in range(n)]
    peers = [
        Peer(
            f"peer-{i:04d}",
            rng.choice([6, 8, 12, 16, 24]) * GB,
            rng.choice([0.35, 0.5, 0.8, 1.2, 2.0, 6.0]),
            rng.random() < 0.75,
        )
        for i in range(n)
    ]
    rtt: dict[str, dict[str, float]] = {}
    for i in range(n):
        row = rtt.setdefault(peers[i].id, {})
        for j in range(n):
            if i != j and rng.random() > 0.05:
                km = math.dist(pts[i], pts[j])
                row[peers[j].id] = 1.0 + km / 100.0 * rng.uniform(1.0, 1.4)  # ~1 ms per 100 km RTT
    return spec, peers, rtt


def brute_force(spec: ModelSpec, peers: list[Peer], rtt: dict) -> float:
    lat = Latency(rtt)
    bpl = spec.bytes_per_layer
    best = math.inf
    ids = [p.id for p in peers]
    cyc: dict[tuple[str, ...], float] = {}
    for k in range(1, len(ids) + 1):
        for combo in itertools.combinations(ids, k):
            m = math.inf
            for perm in itertools.permutations(combo[1:]):
                path = (combo[0], *perm, combo[0])
                m = min(m, sum(lat.hop(a, b) for a, b in zip(path, path[1:], strict=False)))
            cyc[combo] = 0.0 if k == 1 else m
    by_id = {p.id: p for p in peers}
    for combo, lat_ms in cyc.items():
        if math.isinf(lat_ms):
            continue
        for c in combo:
            coord = by_id[c]
            if not coord.coordinator_ok or coord.memory_bytes < spec.coordinator_bytes:
                continue
            # every node but the coordinator holds >= 1 layer; then fastest first
            need = spec.n_layers
            compute = 0.0
            room = []
            ok = True
            for q in combo:
                cap = (by_id[q].memory_bytes - (spec.coordinator_bytes if q == c else 0)) // bpl
                lo = 0 if q == c else 1
                if cap < lo:
                    ok = False
                need -= lo
                compute += lo * by_id[q].ms_per_layer
                room.append((by_id[q].ms_per_layer, cap - lo))
            if not ok or need < 0:
                continue
            for speed, r in sorted(room):
                t = min(r, need)
                need -= t
                compute += t * speed
            if need == 0:
                best = min(best, lat_ms + compute)
    return best


def random_restarts(
    spec: ModelSpec, peers: list[Peer], rtt: dict, rng: random.Random, tries: int
) -> float:
    ctx = Ctx.build(spec, peers, Latency(rtt))
    pool = list(range(ctx.n))
    best = math.inf
    for _ in range(tries):
        coords = [i for i in pool if ctx.capc[i] >= 0]
        cyc = [rng.choice(coords)]
        others = [i for i in pool if i != cyc[0] and ctx.cap[i] > 0]
        rng.shuffle(others)
        start = None
        for p in others:
            cyc.append(p)
            start = evaluate(ctx, cyc)
            if start is not None:
                break
        if start is None:
            continue
        got = local_search(ctx, pool, list(start.cyc))
        if got is not None:
            best = min(best, got.cost)
    return best


def main() -> None:
    quick = "--quick" in sys.argv
    rng = random.Random(20261129)
    result: dict[str, object] = {
        "machine_note": "2 CPU cores shared with other jobs (wall time inflated; cpu time is "
        "this process alone); pure Python",
        "command": "python benchmarks/bench_planner.py" + (" --quick" if quick else ""),
    }

    exact: dict[str, object] = {}
    heur_small: dict[str, object] = {}
    for n, count in ((4, 30), (6, 30), (8, 20), (10, 4)):
        if quick:
            count = max(2, count // 5)
        ratios, hratios, secs = [], [], []
        done = 0
        while done < count:
            spec, peers, rtt = instance(rng, n, n_layers=rng.choice([24, 48, 80]))
            try:
                t0 = time.process_time()
                p = plan(spec, peers, rtt)
                secs.append(time.process_time() - t0)
            except PlanningError:
                continue
            opt = brute_force(spec, peers, rtt)
            ratios.append(p.predicted_traversal_ms / opt)
            h = plan(spec, peers, rtt, exact_limit=0)
            hratios.append(h.predicted_traversal_ms / opt)
            done += 1
        exact[str(n)] = {
            "instances": count,
            "median": statistics.median(ratios),
            "max": max(ratios),
            "median_plan_cpu_s": statistics.median(secs),
        }
        heur_small[str(n)] = {"median": statistics.median(hratios), "max": max(hratios)}
        print(
            f"n={n}: exact ratio median {statistics.median(ratios):.4f} max {max(ratios):.4f}; "
            f"heuristic alone median {statistics.median(hratios):.4f} max {max(hratios):.4f}"
        )
    result["exact_ratio"] = exact
    result["heuristic_small_ratio"] = heur_small

    r50 = []
    tries = 8 if quick else 30
    for _ in range(2 if quick else 6):
        spec, peers, rtt = instance(rng, 50, n_layers=80)
        p = plan(spec, peers, rtt)
        base = random_restarts(spec, peers, rtt, rng, tries)
        r50.append(p.predicted_traversal_ms / base)
    result["restart_ratio_50"] = {
        "instances": len(r50),
        "restarts": tries,
        "median": statistics.median(r50),
        "max": max(r50),
    }
    print(
        f"50 peers: plan / best of {tries} random restarts: median {statistics.median(r50):.4f} "
        f"max {max(r50):.4f}"
    )

    timing: dict[str, object] = {}
    for n in (100, 1000):
        spec, peers, rtt = instance(rng, n, n_layers=80)
        secs, cpu = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            p = plan(spec, peers, rtt)
            secs.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        timing[str(n)] = {
            "median_wall_s": statistics.median(secs),
            "median_cpu_s": statistics.median(cpu),
            "stages": len(p.ring),
        }
        print(
            f"{n} peers: plan() wall {statistics.median(secs):.3f} s, cpu "
            f"{statistics.median(cpu):.3f} s, {len(p.ring)} stages"
        )
    result["plan_seconds"] = timing

    moved, moved_sticky, slowdown = [], [], []
    for _ in range(10 if quick else 40):
        spec, peers, rtt = instance(rng, rng.randint(10, 30), n_layers=80)
        try:
            first = plan(spec, peers, rtt)
        except PlanningError:
            continue
        victim = rng.choice(first.ring)
        rest = [q for q in peers if q.id != victim]
        try:
            second = plan(spec, rest, rtt, previous=first)  # default: sticky unless 25 % slower
            always = plan(spec, rest, rtt, previous=first, sticky_tolerance=math.inf)
            fresh = plan(spec, rest, rtt)
        except PlanningError:
            continue
        held = first.blocks[victim][1] - first.blocks[victim][0]
        moved.append(second.layers_moved / held)
        moved_sticky.append(always.layers_moved / held)
        slowdown.append(always.predicted_traversal_ms / fresh.predicted_traversal_ms)
    result["moved_ratio"] = {
        "cases": len(moved),
        "sticky_tolerance": 0.25,
        "median": statistics.median(moved),
        "max": max(moved),
        "share_exactly_1": sum(1 for m in moved if abs(m - 1) < 1e-9) / len(moved),
        "always_sticky_median": statistics.median(moved_sticky),
        "always_sticky_max": max(moved_sticky),
        "always_sticky_traversal_vs_fresh_median": statistics.median(slowdown),
        "always_sticky_traversal_vs_fresh_max": max(slowdown),
    }
    print(
        f"one peer lost: layers moved / layers it held: median {statistics.median(moved):.3f} "
        f"max {max(moved):.3f}, exactly 1 in {result['moved_ratio']['share_exactly_1']:.0%} "  # type: ignore[index]
        f"of {len(moved)} cases; always sticky: max {max(moved_sticky):.3f}, traversal vs a "
        f"fresh plan median {statistics.median(slowdown):.3f} max {max(slowdown):.3f}"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
