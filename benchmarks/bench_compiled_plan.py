"""How well the plan predicts a ring of compiled nodes' compute: this tree beside a base tree.

    cd /tmp && PYTHONPATH=TREE TREE/.venv/bin/python TREE/benchmarks/bench_compiled_plan.py --ab BASE_TREE
        [--rounds 5] [--new-tokens 64] [--dtype fp32] [--out PATH]

(from outside both trees: ``python -m swarm.node`` puts its working directory first on the path)

Two 3-node swarms of compiled nodes (``join --compile``: launch.py ``compile=True``, spans 64 and
128, context 1,024) on the bundled model, 1 thread a node: one whose nodes import this tree, one
whose nodes import ``--ab`` (PYTHONPATH), started one after the other (the second once the first
serves, so their start-up speed probes do not share the cores). The planner splits the layers by each node's advertised
ms per layer, and the plan predicts its compute (``predicted_compute_ms``: each stage's layers x
its advertised figure). In rounds that alternate which swarm goes first, each swarm runs one
generation of ``--new-tokens`` tokens from a 3-token prompt (no drafting: one-token chunks, the
prefill a negligible share), and each stage's measured compute per chunk is read from its status
(``stage.compute_s`` / ``stage.chunks`` over the run). Per swarm: the plan, the advertised figures,
each stage's predicted and measured ms per chunk, and ``predicted_vs_measured`` (sum of predicted
÷ sum of measured, the median over rounds): 1.0 means the plan knew what the ring computes.
The load average before and after is recorded.

Writes benchmarks/results/compiled_plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm import client  # noqa: E402
from swarm.launch import LocalSwarm, start_local_swarm  # noqa: E402
from swarm.model.bundled import default_model_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "compiled_plan.json"
READY_S = 900.0


async def _status(sw: LocalSwarm, i: int) -> dict[str, Any]:
    async with client.open_client(sw.addrs[i], secret=sw.secret, swarm_id=sw.swarm_id, timeout=60) as (h, p):
        return dict(await client.status(h, p))


async def _stage_counts(sw: LocalSwarm, stages: list[int]) -> dict[int, tuple[float, int]]:
    out = {}
    for i in stages:
        st = (await _status(sw, i))["stage"] or {}
        out[i] = (float(st.get("compute_s", 0.0)), int(st.get("chunks", 0)))
    return out


async def _ready(sw: LocalSwarm) -> None:
    async with client.open_client(sw.addrs[0], secret=sw.secret, swarm_id=sw.swarm_id, timeout=60) as (h, p):
        await client.wait_ready(h, p, timeout=READY_S)


async def _bench(swarms: dict[str, LocalSwarm], a: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, dict[str, Any]] = {}
    for side, sw in swarms.items():
        async with client.open_client(sw.addrs[0], secret=sw.secret, swarm_id=sw.swarm_id, timeout=60) as (h, p):
            st = await client.wait_ready(h, p, timeout=READY_S)
        plan = st["plan"]
        adverts = {q["id"]: q["ms_per_layer"] for q in st["peers_file"]["peers"]}
        stages = [sw.peer_ids.index(q) for q in plan["ring"]]
        predicted = {i: (plan["blocks"][sw.peer_ids[i]][1] - plan["blocks"][sw.peer_ids[i]][0]) * adverts[sw.peer_ids[i]]
                     for i in stages}  # fmt: skip
        coord = sw.peer_ids.index(plan["coordinator"])
        compiled = {i: (await _status(sw, i))["compiled"] for i in stages}
        info[side] = {"plan": plan, "ms_per_layer_advertised": adverts, "stages": stages, "coord": coord,
                      "predicted_ms": predicted, "compiled": compiled, "measured": {i: [] for i in stages}, "ratios": []}  # fmt: skip
    sides = list(swarms)
    for r in range(a.rounds + 1):  # the first round warms up, not counted
        for side in (sides if r % 2 == 0 else sides[::-1]):
            sw, inf = swarms[side], info[side]
            before = await _stage_counts(sw, inf["stages"])
            async with client.open_client(sw.addrs[inf["coord"]], secret=sw.secret, swarm_id=sw.swarm_id,
                                          timeout=120) as (h, p):  # fmt: skip
                await client.generate(h, p, prompt_ids=[1, 2, 3], max_new_tokens=a.new_tokens, draft="none", timeout=120)
            after = await _stage_counts(sw, inf["stages"])
            if r == 0:
                continue
            per = {i: 1000 * (after[i][0] - before[i][0]) / max(1, after[i][1] - before[i][1]) for i in inf["stages"]}
            for i, ms in per.items():
                inf["measured"][i].append(round(ms, 3))
            inf["ratios"].append(sum(inf["predicted_ms"].values()) / sum(per.values()))
    med = statistics.median
    out: dict[str, Any] = {}
    for side, inf in info.items():
        out[side] = {
            "plan_blocks": sorted(inf["plan"]["blocks"].values()),
            "plan_predicted_compute_ms": inf["plan"]["predicted_compute_ms"],
            "ms_per_layer_advertised": {k[:16]: round(v, 4) for k, v in inf["ms_per_layer_advertised"].items()},
            "stages": [{"block": inf["plan"]["blocks"][swarms[side].peer_ids[i]], "predicted_ms": round(inf["predicted_ms"][i], 3),
                        "measured_ms_median": round(med(inf["measured"][i]), 3), "measured_ms": inf["measured"][i],
                        "compiled": inf["compiled"][i]} for i in inf["stages"]],  # fmt: skip
            "predicted_vs_measured": round(med(inf["ratios"]), 3),
            "predicted_vs_measured_runs": [round(x, 3) for x in inf["ratios"]],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", type=Path, required=True, help="the base tree its second swarm's nodes import")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/compiled-plan-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    trees = {"this": ROOT, "base": a.ab.resolve()}
    here = Path.cwd().resolve()
    if any(here == t or t in here.parents for t in trees.values()):  # `python -m swarm.node` puts the cwd first
        raise SystemExit(f"run it from outside both trees (cd /tmp): the nodes would import {here}'s swarm")
    model_dir = default_model_dir()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    swarms = {}
    try:
        for side, tree in trees.items():
            swarms[side] = start_local_swarm(
                3, model_dir, dtype=a.dtype, threads=1, draft="none", workdir=a.workdir / side, context_tokens=1024,
                compile=True, compile_span=128, node_env={i: {"PYTHONPATH": str(tree)} for i in range(3)},
            )  # fmt: skip
            trio.run(_ready, swarms[side])  # the next swarm starts once this one serves: its nodes'
            # start-up speed probes (what the plan predicts from) do not share the cores with those
        res = trio.run(_bench, swarms, a)
    finally:
        for sw in swarms.values():
            sw.stop()
    this, base = res["this"], res["base"]
    doc = {"model": "bundled SmolLM2-135M", "dtype": a.dtype, "threads_per_node": 1, "new_tokens": a.new_tokens,
           "rounds": a.rounds, "base_tree": str(a.ab), "load_avg_before": load0, "load_avg_after": os.getloadavg(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": round(time.perf_counter() - t0, 1),
           "this": this, "base": base}  # fmt: skip
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"this_predicted_vs_measured": this["predicted_vs_measured"],
                      "base_predicted_vs_measured": base["predicted_vs_measured"],
                      "this_blocks": this["plan_blocks"], "base_blocks": base["plan_blocks"],
                      "load": [load0, doc["load_avg_after"]]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
