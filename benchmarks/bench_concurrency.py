"""Many chat sessions at once through the OpenAI endpoint: aggregate throughput, fairness, TTFT.

    .venv/bin/python benchmarks/bench_concurrency.py [--levels 1,2,4,8] [--rounds 2] [--new-tokens 48]
                                                     [--wan] [--model DIR] [--dtype auto]

A 3-peer LAN ring of the bundled model (real node processes on loopback, swarm/launch.py;
``--wan``: every hop through a ``--delay-ms`` one-way delaying proxy) and one API server
(Hypercorn + Starlette in this process, a libp2p client of node 0). Each level runs N chat
sessions at once, each a different question, streamed (``stream: true``) with greedy decoding
and the swarm's default drafter, through plain HTTP (httpx), exactly as the official client
would. Levels run in the order given, then reversed, for ``--rounds`` rounds (ABBA), so a shared
machine's load drifts hit every level alike; the figures are medians over rounds.

Per level: aggregate decode tok/s (all sessions' tokens / the level's wall time from the first
request to the last token), each session's tok/s (its tokens / its own request-to-last-token
time), and time to first token (request -> first content chunk). Ratios, each measured in the
same run: ``aggregate_vs_one`` = aggregate at N / the single session's tok/s (targets: >= 2.5
at 4 and >= 4 at 8 on the LAN ring, >= 3 at 4 on the WAN ring); ``per_session_vs_alone`` =
median session tok/s at N / alone (target >= 0.6 at 4). Also recorded: p95 TTFT, every node's
batching counters and its longest trio-loop hold (status ``stage`` and ``loop``), and whether the
swarm re-planned (it must not). Writes benchmarks/results/concurrency.json (or _wan.json).

``forward_ms`` bounds what batching can give here, measured in this process before the swarm
starts: one decode step of 1, 4 and 8 sessions through each stage of the ring's split (the plan's
blocks, else 13/17 layers) and the LM head, 1 thread, medians. ``compute_ceiling[n]`` = n x the
one-session cycle's compute / the n-session cycle's: the aggregate ÷ one session a perfectly
batched ring would reach if nothing but compute took time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from swarm import client
from swarm.api.backend import ClientBackend
from swarm.api.server import serve_api
from swarm.launch import start_local_swarm

QUESTIONS = [
    "Explain how a binary search works, step by step.",
    "What are three good habits for a beginner learning to cook at home?",
    "Why is the sky blue? Answer in a short paragraph.",
    "Give me a packing list for a weekend hiking trip.",
    "How do vaccines train the immune system?",
    "Write a short poem about the sea at night.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a plan for learning to play the guitar in three months.",
    "How does a refrigerator keep food cold?",
    "What should I consider when adopting a dog?",
]
RESULTS = Path(__file__).resolve().parent / "results"


async def one_session(http: httpx.AsyncClient, model: str, question: str, n: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": n,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft = last = None
    k = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                k = ev["usage"]["completion_tokens"]
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                if ttft is None:
                    ttft = last
    end = last or time.perf_counter()
    return {"tokens": k, "t0": t0, "end": end, "seconds": end - t0, "tok_s": k / (end - t0),
            "ttft_s": (ttft or end) - t0}  # fmt: skip


async def one_level(http: httpx.AsyncClient, model: str, n_sessions: int, n_tokens: int, offset: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [{}] * n_sessions

    async def run(i: int) -> None:
        rows[i] = await one_session(http, model, QUESTIONS[(offset + i) % len(QUESTIONS)], n_tokens)

    async with trio.open_nursery() as nursery:
        for i in range(n_sessions):
            nursery.start_soon(run, i)
    start, end = min(r["t0"] for r in rows), max(r["end"] for r in rows)
    total = sum(r["tokens"] for r in rows)
    ttfts = sorted(r["ttft_s"] for r in rows)
    return {
        "sessions": n_sessions, "tokens": total, "wall_s": end - start, "aggregate_tok_s": total / (end - start),
        "session_tok_s_median": statistics.median(r["tok_s"] for r in rows),
        "session_tok_s_min": min(r["tok_s"] for r in rows),
        "ttft_s_median": statistics.median(ttfts), "ttft_s_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "sessions_detail": [{k: round(v, 4) for k, v in r.items() if k not in ("t0", "end")} for r in rows],
    }  # fmt: skip


async def node_status(swarm: Any, i: int, window_s: int) -> dict[str, Any]:
    try:
        async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.status(h, peer, loop_window_s=window_s)
    except Exception as exc:  # recorded, never lost: the figures above are what the run is for
        return {"node": i, "error": repr(exc)[:500], "log_tail": swarm.log(i)[-2000:]}
    return {"peer": st["peer_id"], "epoch": st["epoch"], "replans": st["replans"], "stage": st["stage"],
            "loop": st["loop"], "capacity": st.get("capacity")}  # fmt: skip


def forward_ms(model_dir: Path, dtype: str, cuts: list[int], repeats: int = 15) -> dict[str, Any]:
    """Median ms of one decode step of n sessions per stage block and the head (module doc)."""
    import torch

    from swarm.model.batched import forward_many
    from swarm.model.dtypes import resolve_dtype
    from swarm.model.generate import LocalModel

    torch.set_num_threads(1)
    model = LocalModel.load(model_dir, stages=list(zip(cuts, cuts[1:], strict=False)), dtype=resolve_dtype(dtype))
    dim, sizes, ctx = model.head.args.dim, (1, 4, 8), 60
    for st in model.stages:
        for s in range(max(sizes)):
            st.open_session(s, 4 * ctx)
            forward_many(st, [(s, torch.randn(ctx, dim))])  # a context like a chat prompt's
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for n in sizes:
            for st in model.stages:
                t0 = time.perf_counter()
                forward_many(st, [(s, torch.randn(1, dim)) for s in range(n)])
                times.setdefault(f"layers_{st.start}_{st.end}:{n}", []).append(time.perf_counter() - t0)
                for s in range(n):
                    st.rollback(s, ctx)
            t0 = time.perf_counter()
            model.head.logits(torch.randn(n, dim))
            times.setdefault(f"head:{n}", []).append(time.perf_counter() - t0)
    ms = {k: round(1000 * statistics.median(v[2:]), 2) for k, v in times.items()}
    cycle = {n: sum(v for k, v in ms.items() if k.endswith(f":{n}")) for n in sizes}
    return {"ms": ms, "cycle_ms": cycle, "compute_ceiling": {n: round(n * cycle[1] / cycle[n], 2) for n in sizes}}


async def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.levels.split(",")]
    kw: dict[str, Any] = {"delay_ms": args.delay_ms} if args.wan else {}
    with start_local_swarm(3, model_dir, dtype=args.dtype, threads=args.threads, **kw) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=600)
            backend = ClientBackend(h, peer, model_dir)
            per_level: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
            t_start = time.monotonic()
            async with trio.open_nursery() as nursery:
                url = await nursery.start(lambda task_status: serve_api(backend, "127.0.0.1:0", task_status=task_status))
                async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
                    await one_level(http, backend.model_name, 2, 8, 0)  # warm-up: discarded
                    for r in range(args.rounds):
                        order = levels if r % 2 == 0 else levels[::-1]
                        for n in order:
                            res = await one_level(http, backend.model_name, n, args.new_tokens, r)
                            per_level[n].append(res)
                            print(f"round {r} level {n}: {res['aggregate_tok_s']:.2f} tok/s aggregate, "
                                  f"session median {res['session_tok_s_median']:.2f}, p95 TTFT {res['ttft_s_p95']:.2f} s",
                                  flush=True)  # fmt: skip
                nursery.cancel_scope.cancel()
        window = min(300, int(time.monotonic() - t_start) + 5)
        nodes = [await node_status(swarm, i, window) for i in range(3)]
    blocks = sorted((st.get("plan") or {}).get("blocks", {}).values())
    cuts = [b[0] for b in blocks] + [blocks[-1][1]] if blocks else [0, 13, 30]
    ceiling = forward_ms(model_dir, args.dtype, cuts)  # after the swarm: its processes are gone

    def med(n: int, key: str) -> float:
        return float(statistics.median(x[key] for x in per_level[n]))

    one = med(1, "session_tok_s_median") if 1 in per_level else None
    summary = {}
    for n in levels:
        summary[str(n)] = {
            "aggregate_tok_s": round(med(n, "aggregate_tok_s"), 3),
            "session_tok_s_median": round(med(n, "session_tok_s_median"), 3),
            "aggregate_vs_one": round(med(n, "aggregate_tok_s") / one, 3) if one else None,
            "per_session_vs_alone": round(med(n, "session_tok_s_median") / one, 3) if one else None,
            "ttft_s_median": round(med(n, "ttft_s_median"), 3),
            "ttft_s_p95": round(med(n, "ttft_s_p95"), 3),
        }
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "what": "N concurrent streamed chat sessions through the OpenAI endpoint on a 3-peer ring; medians over rounds",
        "ring": "wan" if args.wan else "lan", "delay_ms_one_way": args.delay_ms if args.wan else 0.0,
        "model": model_dir.name, "dtype": args.dtype, "threads_per_node": args.threads,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "plan": st.get("plan"),
        "targets": {"aggregate_vs_one": {"4": 3.0 if args.wan else 2.5, "8": None if args.wan else 4.0},
                    "per_session_vs_alone": {"4": 0.6}},
        "summary": summary, "forward_ms": ceiling, "levels": {str(n): per_level[n] for n in levels}, "nodes": nodes,
        "replanned": any(nd.get("replans") for nd in nodes),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "git": git, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": "the HTTP clients, the API server and its libp2p client share this process and its trio loop",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wan", action="store_true")
    ap.add_argument("--delay-ms", type=float, default=25.0)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from swarm.model.bundled import default_model_dir

        args.model = default_model_dir()
    result = trio.run(run, args, args.model)
    out = args.out or RESULTS / ("concurrency_wan.json" if args.wan else "concurrency.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": result["summary"], "replanned": result["replanned"]}, indent=1))


if __name__ == "__main__":
    main()
