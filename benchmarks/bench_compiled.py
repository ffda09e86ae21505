"""The compiled decode step (swarm/model/compiled.py) against eager, per stage, on the bundled model.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compiled.py [--rounds 5] [--steps 32]
        [--threads 1,2] [--dtypes fp32,bf16,bf16+int4] [--blocks 30,10] [--quick] [--out PATH]

For each thread count and dtype, a fresh process (inductor bakes the thread count into its
kernels) loads two copies of a stage of ``--blocks`` layers of SmolLM2-135M: one eager, one
compiled and warmed. Both prefill the same 32-token prompt eagerly, then time ``--steps`` one-token
decode steps (positions 32.., the 64 span); a dtype ``bf16+int4`` (or ``+int8``) holds the layers
in that quant on both sides (torch's packed kernels, called from inside the compiled graph); rounds alternate eager and compiled (which goes first
swaps each round), each round rolls back to the prompt. Per configuration: decode steps per second
of each side per round, their medians, ``ratio`` = median compiled ÷ median eager, and the paired
per-round ratios with their median. ``compile_s``: the warm-up (compile, or the on-disk cache's
load on a rerun). fp32 tokens of the two sides equal (tests/model/test_compiled.py); the
benchmark also checks the hidden states of the first step agree (``first_step_max_abs``).

Writes benchmarks/results/compiled.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "compiled.json"
PROMPT_LEN = 32

from swarm.model.dtypes import cpu_has_native_bf16  # noqa: E402


def measure(threads: int, dtype_name: str, layers: int, rounds: int, steps: int) -> dict[str, Any]:
    """One configuration, in this process: eager and compiled stages alternated."""
    from swarm.model.bundled import default_model_dir
    from swarm.model.compiled import warm_compiled
    from swarm.model.stage import Head, Stage
    from swarm.model.weights import open_checkpoint

    torch.set_num_threads(threads)
    dtype_only, _, quant = dtype_name.partition("+")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_only]
    quant = quant or "none"
    ck = open_checkpoint(default_model_dir())
    head = Head.load(ck.args, ck.source, dtype=dtype)
    eager = Stage.load(ck.args, ck.source, 0, layers, dtype=dtype, quant=quant)
    comp = Stage.load(ck.args, ck.source, 0, layers, dtype=dtype, quant=quant, compile=True, compile_capacity=64)
    t0 = time.perf_counter()
    warm_compiled(comp)
    compile_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompt = head.embed(torch.randint(0, ck.args.vocab_size, (PROMPT_LEN,), generator=g))  # (P, D)
    tok = head.embed(torch.tensor([42]))  # (1, D)
    sides = {"eager": eager, "compiled": comp}
    for name, st in sides.items():
        st.open_session(name, 64)
        st.forward(name, prompt)
    first = [sides[n].forward(n, tok) for n in sides]
    diff = float((first[0].float() - first[1].float()).abs().max())
    tps: dict[str, list[float]] = {n: [] for n in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            st = sides[name]
            st.rollback(name, PROMPT_LEN)
            t = time.perf_counter()
            for _ in range(steps):
                st.forward(name, tok)
            tps[name].append(steps / (time.perf_counter() - t))
    med = {n: statistics.median(v) for n, v in tps.items()}
    paired = [c / e for c, e in zip(tps["compiled"], tps["eager"], strict=True)]
    return {
        "threads": threads, "dtype": dtype_name, "layers": layers, "steps": steps,
        "eager_steps_per_s": [round(x, 2) for x in tps["eager"]],
        "compiled_steps_per_s": [round(x, 2) for x in tps["compiled"]],
        "eager_median": round(med["eager"], 2), "compiled_median": round(med["compiled"], 2),
        "ratio": round(med["compiled"] / med["eager"], 3),
        "paired_ratios": [round(x, 3) for x in paired],
        "paired_ratio_median": round(statistics.median(paired), 3),
        "compile_s": round(compile_s, 1), "first_step_max_abs": diff,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--blocks", default="30,10", help="stage sizes in layers (30: the whole model)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 16 steps")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # threads/dtype/layers: run one config here
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 3, 16
    if a.one:
        t, d, n = a.one.split("/")
        print(json.dumps(measure(int(t), d, int(n), a.rounds, a.steps)))
        return
    rows = []
    for threads in (int(x) for x in a.threads.split(",")):
        for dtype in a.dtypes.split(","):
            for layers in (int(x) for x in a.blocks.split(",")):
                cmd = [sys.executable, __file__, "--one", f"{threads}/{dtype}/{layers}",
                       "--rounds", str(a.rounds), "--steps", str(a.steps)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                print(f"{threads} thread(s) {dtype} {layers} layers: compiled/eager {row['ratio']} "
                      f"(paired {row['paired_ratio_median']}; eager {row['eager_median']} "
                      f"compiled {row['compiled_median']} steps/s; compile {row['compile_s']} s)", file=sys.stderr)
    res = {
        "machine": {"cpu": platform.processor() or platform.machine(), "native_bf16": cpu_has_native_bf16(),
                    "torch": torch.__version__},
        "command": " ".join(sys.argv[1:]), "rows": rows,
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({f"{r['threads']}t/{r['dtype']}/{r['layers']}L": r["ratio"] for r in rows}))


if __name__ == "__main__":
    main()
