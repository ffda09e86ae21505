"""Each peer's measured peak ÷ its predicted peak (planner/budget.py), at load and under 8 sessions.

A local swarm of node processes serves the bundled SmolLM2-135M (``launch.start_local_swarm``:
each node offers just over its share of the planned part, the KV of the 8 sessions each stage
reserves at the context, plus its fixed overhead). Every node's own status reports its whole
predicted peak (``memory.predicted_peak_bytes``: planned part at its dtype's width + the runtime
and the largest dense layer) beside the kernel's VmHWM. Read once the ring serves (``load``: no
session's KV is allocated yet), then after 8 concurrent generations (``sessions_8``: the reserve
in use). Target 0.9–1.05 under 8 sessions: below, the budget wastes memory a peer offered;
above, a peer goes over what it offered.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py [--nodes 3] [--dtype fp32] [--context 512] [--new-tokens 16]

Prints and writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import trio

from swarm import client
from swarm.launch import LocalSwarm, start_local_swarm
from swarm.model.bundled import default_model_dir
from swarm.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
QUESTIONS = ["Name three colours of the sea.", "What is two plus two?", "Say hello in French.",
             "Why is the sky blue?", "Name a prime number.", "What do bees make?", "Count to five.",
             "What is the capital of Italy?"]  # fmt: skip


async def _memory_of_each(swarm: LocalSwarm) -> list[dict[str, Any]]:
    out = []
    for addr in swarm.addrs:  # each node's own status: its predicted and measured peak
        async with client.open_client(addr, secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.status(h, peer)
        m = dict(st.get("memory") or {})
        pred, hwm = m.get("predicted_peak_bytes"), m.get("measured_peak_bytes")
        m["hwm_over_predicted"] = round(hwm / pred, 3) if pred and hwm else None
        m["predicted_over_offered"] = round(pred / m["offered_bytes"], 3) if pred and m.get("offered_bytes") else None
        m["block"] = (st.get("plan") or {}).get("blocks", {}).get(peer)
        m["coordinator"] = (st.get("plan") or {}).get("coordinator") == peer
        out.append(m)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    with start_local_swarm(args.nodes, model_dir, dtype=args.dtype, draft="none", context_tokens=args.context) as swarm:
        offers = [json.loads((swarm.workdir / f"node{i}.json").read_text())["memory_bytes"] for i in range(args.nodes)]
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            await client.wait_ready(h, peer, timeout=300)
        load = await _memory_of_each(swarm)
        t0 = time.monotonic()
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(lambda p=p: client.generate(h, peer, prompt_ids=p, max_new_tokens=args.new_tokens,
                                                                   draft="none", timeout=600))  # fmt: skip
            capacity = (await client.status(h, peer, coordinator=True))["capacity"]
        took = time.monotonic() - t0
        busy = await _memory_of_each(swarm)
        alive = swarm.alive()

    def ratios(rows: list[dict[str, Any]]) -> list[float | None]:
        return [r["hwm_over_predicted"] for r in rows]

    return {
        "command": f"PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py --nodes {args.nodes} --dtype {args.dtype} "
                   f"--context {args.context} --new-tokens {args.new_tokens}",
        "machine": {"cpu": platform.processor() or platform.machine()},
        "nodes": args.nodes, "dtype": args.dtype, "context_tokens": args.context, "offers_bytes": offers,
        "hwm_over_predicted": {"load": ratios(load), "sessions_8": ratios(busy)},
        "target": [0.9, 1.05], "alive": alive, "capacity": capacity, "sessions_seconds": round(took, 1),
        "per_node": {"load": load, "sessions_8": busy},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    out = trio.run(run, args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("hwm_over_predicted", "alive", "capacity", "offers_bytes")}, indent=2))


if __name__ == "__main__":
    main()
