"""Does a compiled node's advertised speed say how fast its block runs? (issue 30, ``join --compile``)

    PYTHONPATH=. .venv/bin/python benchmarks/bench_probe_compiled.py [--rounds 5] [--dtypes fp32,bf16]
        [--blocks 10,20] [--out PATH]

A node advertises the ms per layer it measures at start on one synthetic layer
(``runtime.measure_ms_per_layer``), and the planner splits blocks by it; with ``--compile`` that
probe goes through the compiled step (one graph of one layer). Here, per dtype and block size of
the bundled model (1 thread), in alternated rounds: the probe eager and compiled, and a real block
of that many layers eager and compiled (prefilled 8 tokens, then 40 one-token steps, median per
step ÷ layers). ``probe_ratio`` = the probe's eager ÷ compiled, ``block_ratio`` the block's (medians
of per-round ratios): where they agree, a compiled node's advert scales as its block does, and the
plan's split and predicted compute move with it. ``probe_eager_ms_over_layers``: the eager probe
timed over 2, 4 and 8 synthetic layers instead of one, and ``probe_eager_vs_block_eager``: the
one-layer probe ÷ the real block per layer (below 1: the probe's one layer runs from the cache, a
block's many do not). The machine's load average is recorded.

Writes benchmarks/results/probe_compiled.json.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.model.bundled import default_model_dir  # noqa: E402
from swarm.model.compiled import warm_compiled  # noqa: E402
from swarm.model.dtypes import NAMES  # noqa: E402
from swarm.model.stage import Stage  # noqa: E402
from swarm.model.weights import open_checkpoint  # noqa: E402
from swarm.node.compute.runtime import measure_ms_per_layer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "probe_compiled.json"


def block_ms_per_layer(st: Stage, session: str, steps: int = 40) -> float:
    n = st.end - st.start
    st.open_session(session, 1024)
    st.forward(session, torch.randn(8, st.args.dim, dtype=st.dtype))
    ts = []
    for _ in range(steps):
        x = torch.randn(1, st.args.dim, dtype=st.dtype)
        t0 = time.perf_counter()
        st.forward(session, x)
        ts.append(time.perf_counter() - t0)
    st.close_session(session)
    return 1000 * statistics.median(ts) / n


def probe_layers(args: Any, dtype: torch.dtype, n: int, repeats: int = 15) -> float:
    """The probe's eager ms per layer, but over ``n`` synthetic layers (one forward through all)."""
    st = Stage(args, 0, n, dtype=dtype, device="cpu").to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in st.parameters():
            p.normal_(0.0, 0.02)
    st.requires_grad_(False)
    st.open_session("p", repeats + 2)
    h = torch.randn(1, args.dim, dtype=dtype)
    st.forward("p", h)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        st.forward("p", h)
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts) / n


def measure(dtype_name: str, layers: int, rounds: int) -> dict[str, Any]:
    ck = open_checkpoint(default_model_dir())
    args, dtype = ck.args, NAMES[dtype_name]
    eager = Stage.load(args, ck.source, 0, layers, dtype=dtype, device="cpu")
    comp = Stage.load(args, ck.source, 0, layers, dtype=dtype, device="cpu")
    comp.enable_compiled(1024, 128)
    warm_compiled(comp)
    pe, pc, be, bc = [], [], [], []
    wide: dict[int, list[float]] = {n: [] for n in (2, 4, 8)}
    for r in range(rounds):
        for n in wide:  # the same probe over more layers than the last-level cache holds
            wide[n].append(probe_layers(args, dtype, n))
        pe.append(measure_ms_per_layer(args, dtype, "cpu"))
        pc.append(measure_ms_per_layer(args, dtype, "cpu", compile=True))
        be.append(block_ms_per_layer(eager, f"e{r}"))
        bc.append(block_ms_per_layer(comp, f"c{r}"))
    med = statistics.median
    return {
        "dtype": dtype_name, "layers": layers, "rounds": rounds,
        "probe_eager_ms": round(med(pe), 3), "probe_compiled_ms": round(med(pc), 3),
        "block_eager_ms_per_layer": round(med(be), 3), "block_compiled_ms_per_layer": round(med(bc), 3),
        "probe_eager_ms_over_layers": {n: round(med(v), 3) for n, v in wide.items()},
        "probe_eager_vs_block_eager": round(med(pe) / med(be), 3),
        "probe_ratio": round(med([a / b for a, b in zip(pe, pc, strict=True)]), 3),
        "block_ratio": round(med([a / b for a, b in zip(be, bc, strict=True)]), 3),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--blocks", default="10,20")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    rows = [measure(d, int(n), a.rounds) for d in a.dtypes.split(",") for n in a.blocks.split(",")]
    res = {"model": "bundled SmolLM2-135M", "threads": 1, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}  # fmt: skip
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
