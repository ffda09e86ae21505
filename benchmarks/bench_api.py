"""The OpenAI-compatible endpoint's cost, side by side with the swarm's own client on one swarm.

    .venv/bin/python benchmarks/bench_api.py [--nodes 2] [--new-tokens 64] [--repeats 5] [--model DIR]

One local swarm of node processes (the bundled SmolLM2-135M-Instruct unless --model), one API
server (Hypercorn + Starlette in this process's trio.run, a libp2p client of node 0). Each round
runs, in alternating order, the same greedy chat generation (same prompt ids, same max tokens,
the swarm's default drafter) two ways:

- direct: ``swarm.client.generate`` (what ``shard-swarm generate`` does);
- api: ``POST /v1/chat/completions`` with ``stream: true`` through plain HTTP (httpx), read
  until ``[DONE]``; tokens counted from the ``usage`` chunk.

Written to benchmarks/results/api.json: median tok/s of each (tokens / wall time from request to
the last token), ``ratio`` = api / direct (target >= 0.95), ``paired_ratio_median`` (the median of
each round's api / direct, which cancels slow drifts of a shared machine's load), and the median
time to first token of each (api: first content chunk on the HTTP stream; direct: first ``tokens`` frame).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from swarm import client
from swarm.api.backend import ClientBackend
from swarm.api.server import serve_api
from swarm.launch import start_local_swarm
from swarm.model.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Explain how a binary search works, step by step."}]
OUT = Path(__file__).resolve().parent / "results" / "api.json"


async def direct_once(h: Any, peer: str, ids: list[int], n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    first: list[float] = []

    def on_tokens(tok_ids: list[int], text: str) -> None:
        if not first:
            first.append(time.perf_counter())

    r = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=n, temperature=0.0, timeout=120,
                              on_tokens=on_tokens)  # fmt: skip
    dt = time.perf_counter() - t0
    k = len(r["output_token_ids"])
    return {"tokens": k, "seconds": dt, "tok_s": k / dt, "ttft_s": first[0] - t0}


async def api_once(http: httpx.AsyncClient, model: str, n: int) -> dict[str, float]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, k = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                k = ev["usage"]["completion_tokens"]
            if ttft is None and ev["choices"] and ev["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter()
    dt = time.perf_counter() - t0
    return {"tokens": k, "seconds": dt, "tok_s": k / dt, "ttft_s": (ttft or t0) - t0}


async def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    with start_local_swarm(args.nodes, model_dir, dtype=args.dtype, threads=args.threads) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            t = time.perf_counter()
            st = await client.wait_ready(h, peer, timeout=300)
            ready_s = time.perf_counter() - t
            backend = ClientBackend(h, peer, model_dir)
            async with trio.open_nursery() as nursery:
                url = await nursery.start(lambda task_status: serve_api(backend, "127.0.0.1:0", task_status=task_status))
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    await direct_once(h, peer, ids, 8)  # warm both paths
                    await api_once(http, backend.model_name, 8)
                    direct, api = [], []
                    for i in range(args.repeats):
                        order = ("direct", "api") if i % 2 == 0 else ("api", "direct")
                        for which in order:
                            if which == "direct":
                                direct.append(await direct_once(h, peer, ids, args.new_tokens))
                            else:
                                api.append(await api_once(http, backend.model_name, args.new_tokens))
                nursery.cancel_scope.cancel()

    def med(rows: list[dict[str, float]], key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    assert {r["tokens"] for r in direct} == {r["tokens"] for r in api}, (direct, api)
    return {
        "what": "tok/s through the OpenAI endpoint (streaming SSE) / swarm client.generate, same swarm and prompt",
        "model": model_dir.name, "nodes": args.nodes, "dtype": args.dtype, "threads_per_node": args.threads,
        "plan": st.get("plan"), "ready_s": ready_s, "new_tokens": args.new_tokens,
        "tokens_generated": direct[0]["tokens"], "repeats": args.repeats,
        "direct_tok_s_median": med(direct, "tok_s"), "api_tok_s_median": med(api, "tok_s"),
        "ratio": med(api, "tok_s") / med(direct, "tok_s"), "target_ratio": 0.95,
        "paired_ratio_median": float(statistics.median(a["tok_s"] / d["tok_s"] for a, d in zip(api, direct, strict=True))),
        "direct_ttft_ms_median": 1000 * med(direct, "ttft_s"), "api_ttft_ms_median": 1000 * med(api, "ttft_s"),
        "direct": direct, "api": api,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "note": "the HTTP client, the API server and the libp2p client share one process and trio loop",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from swarm.model.bundled import default_model_dir

        args.model = default_model_dir()
    result = trio.run(run, args, args.model)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("direct_tok_s_median", "api_tok_s_median", "ratio", "paired_ratio_median", "direct_ttft_ms_median", "api_ttft_ms_median")
    print(json.dumps({k: round(result[k], 3) for k in keys}))


if __name__ == "__main__":
    main()
