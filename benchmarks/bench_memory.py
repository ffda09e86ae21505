"""Each peer's measured peak ÷ its predicted peak (planner/budget.py): at load, under 8 sessions,
at a re-plan, and for an int4 swarm.

Local swarms of node processes serve the bundled SmolLM2-135M (``launch.start_local_swarm``: each
node offers just over its share of the planned part, the KV of the 8 sessions each stage reserves
at the context, plus its fixed overhead). Every node's own status reports its whole predicted
peak (``memory.predicted_peak_bytes``: planned part at its dtype's width + the runtime and the
largest dense layer) beside the kernel's VmHWM. Phases:

- ``load``: once the ring serves (no session's KV allocated yet), over the peak predicted at load
  (``memory.predicted_load_peak_bytes``: no KV, no activations; ``load_hwm_over_whole_predicted``
  gives the same VmHWM over the whole predicted peak);
- ``sessions_8``: after 8 concurrent generations whose prompts fill the context (every session's
  KV written to the end, the prefill chunks' activations used);
- ``replan``: a second swarm whose three nodes each offer enough for half the model; a stage is
  killed, the survivors take its layers (each frees its old block, then loads the new one; its
  ``after_load`` over the new block's peak at load), then 8 sessions again; the survivors' VmHWM
  over their whole life;
- ``int4_sessions_8``: the first phase's swarm and sessions with ``--quant int4`` from the bf16
  safetensors (``--no-int4`` skips it; ``--int8`` adds the same with ``--quant int8``).

Target 0.9–1.05: below, the budget wastes memory a peer offered; above, a peer goes over what it
offered. A head-only coordinator or a standby predicts nothing for a block it does not hold.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py [--nodes 3] [--dtype fp32] [--context 512] [--new-tokens 16] [--no-int4] [--int8] [--no-replan] [--out PATH]

Prints and writes benchmarks/results/memory.json (or ``--out``), with the load average at its start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import trio

from swarm import client
from swarm.launch import LocalSwarm, sized_offers, start_local_swarm
from swarm.model.bundled import default_model_dir
from swarm.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
QUESTIONS = ["Name three colours of the sea.", "What is two plus two?", "Say hello in French.",
             "Why is the sky blue?", "Name a prime number.", "What do bees make?", "Count to five.",
             "What is the capital of Italy?"]  # fmt: skip
FILLER = "Here is some background that the answer may use, read it carefully. "


def _prompts(context: int, new_tokens: int) -> list[list[int]]:
    """Eight chat prompts, each as long as leaves ``new_tokens`` of the context (the question last)."""
    tok = Tokenizer.from_dir(default_model_dir())
    out = []
    for q in QUESTIONS:
        text = q
        while len(tok.encode(tok.apply_chat_template([{"role": "user", "content": FILLER + text}]))) <= context - new_tokens - 2:
            text = FILLER + text
        out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
    return out


async def _memory_of_each(swarm: LocalSwarm, nodes: list[int]) -> list[dict[str, Any]]:
    out = []
    for i in nodes:  # each node's own status: its predicted and measured peak
        async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.status(h, peer)
        m = dict(st.get("memory") or {})
        pred, hwm, load = m.get("predicted_peak_bytes"), m.get("measured_peak_bytes"), m.get("predicted_load_peak_bytes")
        m["hwm_over_predicted"] = round(hwm / pred, 3) if pred and hwm else None
        m["hwm_over_predicted_load"] = round(hwm / load, 3) if load and hwm else None
        m["hwm_over_offered"] = round(hwm / m["offered_bytes"], 3) if hwm and m.get("offered_bytes") else None
        m["block"] = (st.get("plan") or {}).get("blocks", {}).get(peer)
        m["coordinator"] = (st.get("plan") or {}).get("coordinator") == peer
        m["max_queued"] = (st.get("stage") or {}).get("max_queued")  # its stage's inbound queue at most (messages)
        out.append(m)
    return out


async def _sessions(swarm: LocalSwarm, node: int, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts at once through ``node``; the coordinator's capacity afterwards and the seconds."""
    t0 = time.monotonic()
    async with client.open_client(swarm.addrs[node], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        await client.wait_ready(h, peer, timeout=300)
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(lambda p=p: client.generate(h, peer, prompt_ids=p, max_new_tokens=new_tokens,
                                                               draft="none", timeout=600))  # fmt: skip
        capacity = (await client.status(h, peer, coordinator=True))["capacity"]
    return {"capacity": capacity, "seconds": round(time.monotonic() - t0, 1)}


async def _steady(args: argparse.Namespace, prompts: list[list[int]], quant: str) -> dict[str, Any]:
    nodes = list(range(args.nodes))
    with start_local_swarm(args.nodes, default_model_dir(), dtype=args.dtype, draft="none", context_tokens=args.context,
                           quant=quant) as swarm:  # fmt: skip
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            await client.wait_ready(h, peer, timeout=300)
        load = await _memory_of_each(swarm, nodes)
        ran = await _sessions(swarm, 0, prompts, args.new_tokens)
        busy = await _memory_of_each(swarm, nodes)
        return {"load": load, "sessions_8": busy, "alive": swarm.alive(), **ran}


async def _replan(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    model = default_model_dir()
    offer = sized_offers(2, model, [args.dtype], context_tokens=args.context, draft="none")[0]
    with start_local_swarm(3, model, dtype=args.dtype, draft="none", context_tokens=args.context,
                           memory_bytes=[offer] * 3) as swarm:  # fmt: skip
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            first = await client.wait_ready(h, peer, timeout=300)
        plan = first["plan"]
        victim = next(swarm.peer_ids.index(p) for p in reversed(plan["ring"]) if p != plan["coordinator"])
        survivors = [i for i in range(3) if i != victim]
        before = await _memory_of_each(swarm, survivors)
        swarm.kill(victim)
        node = swarm.peer_ids.index(plan["coordinator"])
        async with client.open_client(swarm.addrs[node], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            with trio.fail_after(300):
                while (st := await client.status(h, peer, coordinator=True)).get("epoch") == first["epoch"] \
                        or not st.get("serving"):  # fmt: skip
                    await trio.sleep(0.25)
        after_load = await _memory_of_each(swarm, survivors)
        ran = await _sessions(swarm, node, prompts, args.new_tokens)
        busy = await _memory_of_each(swarm, survivors)
        return {"blocks_before": plan["blocks"], "blocks_after": st["plan"]["blocks"], "offer_bytes": offer,
                "before": before, "after_load": after_load, "sessions_8": busy, "alive": swarm.alive(), **ran}  # fmt: skip


def _ratios(rows: list[dict[str, Any]], key: str = "hwm_over_predicted") -> list[float | None]:
    return [r[key] for r in rows]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    start_load = os.getloadavg()
    prompts = _prompts(args.context, args.new_tokens)
    fp = await _steady(args, prompts, "none")
    rp = await _replan(args, prompts) if args.replan else None
    q4 = await _steady(args, prompts, "int4") if args.int4 else None
    q8 = await _steady(args, prompts, "int8") if args.int8 else None
    at_load = "hwm_over_predicted_load"  # once serving, before any session: the peak predicted at load
    ratios = {"load": _ratios(fp["load"], at_load), "sessions_8": _ratios(fp["sessions_8"]),
              **({"replan_after_load": _ratios(rp["after_load"], at_load), "replan_sessions_8": _ratios(rp["sessions_8"])}
                 if rp else {})}  # fmt: skip
    if q4 is not None:
        ratios |= {"int4_load": _ratios(q4["load"], at_load), "int4_sessions_8": _ratios(q4["sessions_8"])}
    if q8 is not None:
        ratios |= {"int8_load": _ratios(q8["load"], at_load), "int8_sessions_8": _ratios(q8["sessions_8"])}
    # the same VmHWM at load over the whole predicted peak (its sessions' KV not yet written)
    at_load_of_whole = {"load": _ratios(fp["load"]), **({"replan_after_load": _ratios(rp["after_load"])} if rp else {})}
    if q4 is not None:
        at_load_of_whole["int4_load"] = _ratios(q4["load"])
    if q8 is not None:
        at_load_of_whole["int8_load"] = _ratios(q8["load"])
    over = [r["hwm_over_offered"] for ph in (fp, rp, q4, q8) if ph for k in ("sessions_8",) for r in ph[k]]
    return {
        "command": f"PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py --nodes {args.nodes} --dtype {args.dtype} "
                   f"--context {args.context} --new-tokens {args.new_tokens}" + ("" if args.int4 else " --no-int4")
                   + (" --int8" if args.int8 else "") + ("" if args.replan else " --no-replan") + ("" if args.out == RESULTS else f" --out {args.out}"),
        "machine": {"cpu": platform.processor() or platform.machine(), "load_average_start": start_load,
                    "load_average": os.getloadavg()},
        "nodes": args.nodes, "dtype": args.dtype, "context_tokens": args.context,
        "prompt_tokens": [len(p) for p in prompts],
        "hwm_over_predicted": ratios, "load_hwm_over_whole_predicted": at_load_of_whole,
        "max_hwm_over_offered": max(x for x in over if x is not None),
        "target": [0.9, 1.05], "phases": {"fp32": fp, "replan": rp, "int4": q4, "int8": q8},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--no-int4", dest="int4", action="store_false")
    ap.add_argument("--int8", action="store_true", help="also an int8 swarm, as the int4 one")
    ap.add_argument("--no-replan", dest="replan", action="store_false", help="skip the re-plan phase")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file (default: benchmarks/results/memory.json)")
    args = ap.parse_args()
    out = trio.run(run, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("hwm_over_predicted", "load_hwm_over_whole_predicted", "max_hwm_over_offered",
                                          "machine")}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
