"""A head-only coordinator inside a memory limit of its offer, under 8 sessions of long prompts.

A coordinator that holds no layers still receives every piece of every prompt from the tail
(a window of 8 pieces of 64 tokens a session in flight: model/speculative.DEFAULT_PREFILL_WINDOW)
and runs the LM head on each session's chunks (up to 9 rows a chunk with the default n-gram
drafter: the logits of a 262k-token vocabulary are 1 MB a row in float32). The budget counts both
per session (ModelSpec.head_session_bytes, planner/budget.py); this measures it.

Three node processes on loopback serve ``--model`` in fp32 (``--dtype``), each inside a memory
cgroup whose limit is its offer (swarm.testing.memlimit): node 0 offers the head and its sessions
with a third of a layer to spare (``launch.offer_for``), so it can only coordinate, holding no
layer; nodes 1 and 2 offer half the layers each with the same spare, too little for the head. Eight
sessions at once, each a prompt of ``--prompt-tokens`` (a phrase repeated, so the drafter proposes
and the head sees its longest chunks) and ``--new-tokens`` more. Per node, from its own status:
VmHWM ÷ its whole predicted peak, ÷ its offer, and the coordinator's prediction without the
per-session term (``predicted_without_sessions_bytes``: what it was before the budget counted it);
the cgroups' OOM kills; and the outputs equal one process's.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_head_memory.py [--model gemma3-270m] [--context 2048] [--prompt-tokens 1900] [--new-tokens 48] [--out PATH]

Writes benchmarks/results/head_memory.json (or ``--out``) with the load average at start and end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

from swarm import client
from swarm.launch import offer_for, open_checkpoint, start_local_swarm
from swarm.model.capability import swarm_head_quant
from swarm.model.dtypes import resolve_dtype
from swarm.model.generate import LocalModel, generate
from swarm.model.packaged import resolve_model
from swarm.node.settings import model_spec
from swarm.testing.memlimit import memlimit_unavailable_reason, memory_cgroup

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "head_memory.json"
SESSIONS = 8
SPARE = 0.3  # of a layer, beside each offer's planned part


def _prompts(n: int, tokens: int) -> list[list[int]]:
    """``n`` prompts of ``tokens`` ids: a 40-token phrase of its own repeated (the drafter finds it)."""
    return [[1] + [(i % 40) * 97 + 311 * k + 100 for i in range(tokens - 1)] for k in range(n)]


def offers(model: Path, dtype: str, context: int, quant: str = "none") -> list[int]:
    """Node 0: the head and its sessions; nodes 1 and 2: half the layers each (module doc)."""
    half = math.ceil(open_checkpoint(model).args.n_layers / 2)
    head = offer_for(model, SPARE, dtype=dtype, context_tokens=context, coordinator=True, quant=quant)
    stage = offer_for(model, half + SPARE, dtype=dtype, context_tokens=context, coordinator=False, quant=quant)
    return [head, stage, stage]


async def _status(swarm: Any, i: int, **kw: Any) -> dict[str, Any]:
    async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        return await client.status(h, peer, **kw)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load0 = os.getloadavg()
    model = resolve_model(args.model)
    prompts = _prompts(SESSIONS, args.prompt_tokens)
    torch.set_num_threads(1)
    dt = resolve_dtype(args.dtype, torch.device("cpu"))
    ck = open_checkpoint(model).args
    # the one box holds the head as the quantized swarm's coordinator does (capability.swarm_head_quant)
    head_quant = swarm_head_quant(args.quant, ck.head_stored, torch.device("cpu"), dt)
    box = LocalModel.load(model, stages=1, dtype=dt, quant=args.quant, head_quant=head_quant)
    want = [generate(box, p, max_new_tokens=args.new_tokens).output_token_ids for p in prompts[:2]]
    del box
    limits = offers(model, args.dtype, args.context, args.quant)
    extra = int(args.head_extra_mb * 1e6)  # the coordinator's cgroup only: its offer stays the budget's
    per_session = model_spec(ck, torch.bfloat16, args.context, args.quant).at_width(dt.itemsize).head_session_bytes()
    per_session_real = per_session * dt.itemsize // 2
    with start_local_swarm(3, model, dtype=args.dtype, device="cpu", draft="ngram", context_tokens=args.context,
                           memory_bytes=limits, quant=args.quant) as swarm, contextlib.ExitStack() as stack:  # fmt: skip
        cgroups = [stack.enter_context(memory_cgroup(limit + (extra if i == 0 else 0), f"bench-head-{i}"))
                   for i, limit in enumerate(limits)]  # fmt: skip
        for cg, proc in zip(cgroups, swarm.procs, strict=True):
            cg.add(proc.pid)  # at once: before it has imported torch
        try:
            try:
                async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
                    ready = await client.wait_ready(h, peer, timeout=args.ready_s)
            except Exception:
                for i, cg in enumerate(cgroups):
                    print(f"node {i}: offer {limits[i]}, OOM kills {cg.oom_kills()}, alive {swarm.alive()[i]}\n"
                          f"{swarm.log(i)[-1500:]}", file=sys.stderr)  # fmt: skip
                raise
            plan = ready["plan"]
            coord = swarm.peer_ids.index(plan["coordinator"])
            if plan["blocks"].get(plan["coordinator"]):
                sys.exit(f"the coordinator holds layers {plan['blocks'][plan['coordinator']]}: not head-only")
            at_load = [(await _status(swarm, i))["memory"] for i in range(3)]
            for proc in swarm.procs:  # VmHWM from here on is the serving peak (the load's is in at_load)
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
            before = [(await _status(swarm, i))["memory"] for i in range(3)]
            got: list[dict[str, Any]] = [{} for _ in prompts]
            t0 = time.monotonic()
            async with client.open_client(swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):

                async def one(k: int) -> None:
                    got[k] = await client.generate(h, peer, prompt_ids=prompts[k], max_new_tokens=args.new_tokens,
                                                   timeout=900)  # fmt: skip

                async with trio.open_nursery() as nursery:
                    for k in range(len(prompts)):
                        nursery.start_soon(one, k)
            seconds = time.monotonic() - t0
            capacity = (await _status(swarm, coord, coordinator=True))["capacity"]
            after = [(await _status(swarm, i))["memory"] for i in range(3)]
            alive = swarm.alive()
            kills = [cg.oom_kills() for cg in cgroups]
            peaks = [cg.peak_bytes() for cg in cgroups]
        finally:
            swarm.stop()
    nodes = []
    for i in range(3):
        m, load = after[i], at_load[i]
        pred, serving = m["predicted_peak_bytes"], m["measured_peak_bytes"]
        hwm = max(serving, load["measured_peak_bytes"])  # the process's whole life
        row = {"node": i, "coordinator": i == coord, "block": plan["blocks"].get(swarm.peer_ids[i]),
               "offered_bytes": limits[i], "predicted_peak_bytes": pred, "measured_peak_bytes": hwm,
               "measured_peak_at_load_bytes": load["measured_peak_bytes"], "serving_peak_bytes": serving,
               "rss_before_sessions_bytes": before[i]["measured_rss_bytes"], "cgroup_peak_bytes": peaks[i],
               "hwm_over_predicted": round(hwm / pred, 3) if pred else None,
               "serving_peak_over_predicted": round(serving / pred, 3) if pred else None,
               "hwm_over_offered": round(hwm / limits[i], 3), "oom_kills": kills[i], "alive": alive[i]}  # fmt: skip
        if i == coord:
            without = pred - SESSIONS * per_session_real
            row |= {"per_session_bytes": per_session_real, "sessions_predicted_bytes": SESSIONS * per_session_real,
                    "predicted_without_sessions_bytes": without,
                    "hwm_over_predicted_without_sessions": round(hwm / without, 3),
                    "serving_peak_over_predicted_without_sessions": round(serving / without, 3),
                    # what the sessions really added: the serving peak over the resident set they started from
                    "sessions_measured_bytes": serving - before[i]["measured_rss_bytes"]}  # fmt: skip
        nodes.append(row)
    head = nodes[coord]
    return {
        "what": "a head-only coordinator in a memory cgroup at its offer, 8 sessions of long prompts with drafting",
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/bench_head_memory.py"
                   + (f" --model {args.model}" if args.model else "")
                   + f" --dtype {args.dtype} --quant {args.quant} --context {args.context} --prompt-tokens {args.prompt_tokens} "
                   f"--new-tokens {args.new_tokens}" + (f" --head-extra-mb {args.head_extra_mb:g}" if args.head_extra_mb else ""),
        "model": model.name, "quant": args.quant, "head_quant": head_quant,
        "receipt_head_quant": [g.get("head_quant") for g in got[:1]], "vocab_size": ck.vocab_size, "dim": ck.dim, "context": args.context,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "sessions": SESSIONS,
        "coordinator_hwm_over_predicted": head["hwm_over_predicted"],
        "coordinator_hwm_over_predicted_without_sessions": head["hwm_over_predicted_without_sessions"],
        "head_extra_bytes": int(args.head_extra_mb * 1e6),
        "target": [0.9, 1.05], "oom_kills": sum(kills), "all_alive": all(alive),
        "outputs_equal_one_box": [g.get("output_token_ids") for g in got[:2]] == want,
        "accepted_per_traversal": [g.get("accepted_per_traversal") for g in got],
        "ring_capacity": capacity, "seconds": round(seconds, 1), "plan": plan, "nodes": nodes,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_average_start": load0,
                    "load_average_end": os.getloadavg()},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a packaged model's name or a path (default: the bundled one)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--quant", default="none", help="the invite's quant (a quantized swarm's coordinator holds a head "
                    "stored in 5-8 bits int8: capability.swarm_head_quant)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ready-s", type=float, default=300, help="how long to wait for the ring to serve")
    ap.add_argument("--head-extra-mb", type=float, default=0.0,
                    help="added to the coordinator's cgroup limit, not its offer (a head whose load the budget undercounts)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if (why := memlimit_unavailable_reason()) is not None:
        sys.exit(f"no memory limit: {why}")
    result = trio.run(run, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    head = next(n for n in result["nodes"] if n["coordinator"])
    print(json.dumps({k: head[k] for k in ("sessions_predicted_bytes", "sessions_measured_bytes", "serving_peak_over_predicted",
                                            "serving_peak_over_predicted_without_sessions", "measured_peak_at_load_bytes",
                                            "serving_peak_bytes")}))
    keys = ("coordinator_hwm_over_predicted", "coordinator_hwm_over_predicted_without_sessions", "oom_kills",
            "all_alive", "outputs_equal_one_box", "seconds")
    print(json.dumps({k: result[k] for k in keys} | {"hwm_over_predicted": [n["hwm_over_predicted"] for n in result["nodes"]],
                                                     "hwm_over_offered": [n["hwm_over_offered"] for n in result["nodes"]]}))


if __name__ == "__main__":
    main()
