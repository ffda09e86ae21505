"""The compiled decode step (swarm/model/compiled.py) against eager, per stage, on the bundled model.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compiled.py [--rounds 5] [--steps 32]
        [--threads 1,2] [--dtypes fp32,bf16,bf16+int4] [--blocks 30,10] [--chunks 2,4,8] [--quick] [--out PATH]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_compiled.py --e2e [--rounds 3] [--dtypes fp32,bf16+int4]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_compiled.py --prefill [--threads 1] [--dtypes ...] [--blocks 10]

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

``--chunks``: verify chunks of that many rows (a drafted chunk: 1 + K tokens) through the same
two stages, in the same alternated rounds: each of ``--steps`` chunks at position 32 (rolled back
after each, as a rejected draft is), compiled ÷ eager chunks per second per row count
(``chunks``; a chunk of rows not in compiled.ROWS is padded up to the next).

``--prefill``: whether prompt pieces (64 rows, speculative.DEFAULT_PREFILL_CHUNK) would gain from
the same compiled step at that larger shape (not built: see benchmarks/README.md): a third stage
compiled at rows (1, 64), capacity 256, against the eager one, each round 5 pieces of 64 rows at
position 64 (span 128, rolled back after each), prefill tokens per second (``prefill``), and the
one graph's compile time.

``--e2e``: the user's path, ``run --json --threads 1 --draft ngram`` with and without
``--compile`` as fresh processes, alternated, on a repetitive prompt (code to continue), the
median of each side's ``decode_tokens_per_s`` and whether the tokens are equal; ``warm_s``: the
compiled side's warm-up (inductor's on-disk cache after the first run).

Writes benchmarks/results/compiled.json (``--e2e``: compiled_e2e.json).
"""

from __future__ import annotations

import argparse
import json
import os
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


def measure(threads: int, dtype_name: str, layers: int, rounds: int, steps: int,
            chunks: tuple[int, ...] = (), prefill: bool = False) -> dict[str, Any]:
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
    cps: dict[tuple[str, int], list[float]] = {(n, T): [] for n in sides for T in chunks}
    rows = head.embed(torch.randint(0, ck.args.vocab_size, (max(chunks, default=1),), generator=g))  # (T, D)
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            st = sides[name]
            st.rollback(name, PROMPT_LEN)
            t = time.perf_counter()
            for _ in range(steps):
                st.forward(name, tok)
            tps[name].append(steps / (time.perf_counter() - t))
        for T in chunks:  # verify chunks of T rows at position 32, each rolled back
            for name in order:
                st = sides[name]
                t = time.perf_counter()
                for _ in range(steps):
                    st.rollback(name, PROMPT_LEN)
                    st.forward(name, rows[:T])
                cps[(name, T)].append(steps / (time.perf_counter() - t))
    piece = measure_pieces(ck, head, eager, dtype, quant, layers, rounds) if prefill else None
    chunk_rows = {}
    for T in chunks:
        e, c = cps[("eager", T)], cps[("compiled", T)]
        pairs = [x / y for x, y in zip(c, e, strict=True)]
        chunk_rows[str(T)] = {
            "eager_chunks_per_s": [round(x, 2) for x in e], "compiled_chunks_per_s": [round(x, 2) for x in c],
            "ratio": round(statistics.median(c) / statistics.median(e), 3),
            "paired_ratio_median": round(statistics.median(pairs), 3),
        }  # fmt: skip
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
        "compile_s": round(compile_s, 1), "first_step_max_abs": diff, "chunks": chunk_rows, "prefill": piece,
        "rows_compiled": list(comp.compiled.rows) if comp.compiled is not None else [],
    }  # fmt: skip


def measure_pieces(ck: Any, head: Any, eager: Any, dtype: torch.dtype, quant: str, layers: int,
                   rounds: int) -> dict[str, Any]:
    """64-row prompt pieces at position 64 through a stage compiled at rows (1, 64) ÷ eager."""
    from swarm.model.stage import Stage

    P = 64
    comp = Stage.load(ck.args, ck.source, 0, layers, dtype=dtype, quant=quant)
    comp.enable_compiled(256, rows=(1, P))
    g = torch.Generator().manual_seed(1)
    prompt = head.embed(torch.randint(0, ck.args.vocab_size, (2 * P,), generator=g))  # (2P, D)
    sides = {"eager-piece": eager, "compiled-piece": comp}
    for name, st in sides.items():
        st.open_session(name, 256)
        st.forward(name, prompt[:P])  # eager: the first piece is the causal prefill from 0
    t0 = time.perf_counter()
    comp.forward("compiled-piece", prompt[P:])  # compiles the (span 128, 64 rows) graph
    compile_s = time.perf_counter() - t0
    tps: dict[str, list[float]] = {n: [] for n in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            st = sides[name]
            t = time.perf_counter()
            for _ in range(5):
                st.rollback(name, P)
                st.forward(name, prompt[P:])
            tps[name].append(5 * P / (time.perf_counter() - t))
    e, c = tps["eager-piece"], tps["compiled-piece"]
    return {
        "eager_tok_s": [round(x) for x in e], "compiled_tok_s": [round(x) for x in c],
        "ratio": round(statistics.median(c) / statistics.median(e), 3),
        "paired_ratio_median": round(statistics.median([x / y for x, y in zip(c, e, strict=True)]), 3),
        "compile_s": round(compile_s, 1),
    }  # fmt: skip


E2E_PROMPT = "".join(f"def {op}(a, b):\n    return a {sym} b\n\n\n" for op, sym in
                     (("add", "+"), ("sub", "-"), ("mul", "*"))) + "def div(a, b):\n"  # fmt: skip


def run_once(dtype_name: str, compiled: bool, new_tokens: int) -> dict[str, Any]:
    """One ``run --json`` process (the CLI a user runs), drafting with ngram."""
    dtype, _, quant = dtype_name.partition("+")
    cmd = [sys.executable, "-c", "from swarm.cli.main import app; app()", "run", "--json", "--threads", "1",
           "--dtype", dtype, "--quant", quant or "none", "--draft", "ngram", "--no-chat",
           "--max-new-tokens", str(new_tokens), "--prompt", E2E_PROMPT] + (["--compile"] if compiled else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return dict(json.loads(out))


def e2e(dtypes: list[str], rounds: int, new_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for dtype in dtypes:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for r in range(rounds):
            for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                runs[compiled].append(run_once(dtype, compiled, new_tokens))
        tps = {c: [x["decode_tokens_per_s"] for x in v] for c, v in runs.items()}
        pairs = [c / e for c, e in zip(tps[True], tps[False], strict=True)]
        rows.append({
            "dtype": dtype, "new_tokens": new_tokens, "eager_decode_tok_s": tps[False], "compiled_decode_tok_s": tps[True],
            "ratio": round(statistics.median(tps[True]) / statistics.median(tps[False]), 3),
            "paired_ratio_median": round(statistics.median(pairs), 3),
            "accepted_per_round": [x["accepted_per_round"] for x in runs[True]],
            "same_tokens": all(x["output_token_ids"] == runs[False][0]["output_token_ids"] for x in runs[True] + runs[False]),
            "warm_s": [x["compiled"]["warm_s"] for x in runs[True]], "rows": runs[True][0]["compiled"].get("rows"),
        })  # fmt: skip
        print(f"e2e {dtype}: compiled/eager decode {rows[-1]['ratio']} (paired {rows[-1]['paired_ratio_median']}; "
              f"eager {tps[False]} compiled {tps[True]} tok/s; same tokens {rows[-1]['same_tokens']})", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--blocks", default="30,10", help="stage sizes in layers (30: the whole model)")
    ap.add_argument("--chunks", default="", help="verify-chunk row counts to time too, e.g. 2,4,8")
    ap.add_argument("--prefill", action="store_true", help="64-row prompt pieces compiled at that shape too")
    ap.add_argument("--e2e", action="store_true", help="run --draft ngram with and without --compile, end to end")
    ap.add_argument("--new-tokens", type=int, default=200, help="--e2e: tokens a run generates")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 16 steps")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # threads/dtype/layers: run one config here
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 3, 16
    chunks = tuple(int(x) for x in a.chunks.split(",") if x)
    if a.one:
        t, d, n = a.one.split("/")
        print(json.dumps(measure(int(t), d, int(n), a.rounds, a.steps, chunks, a.prefill)))
        return
    if a.e2e:
        load = os.getloadavg()
        rows = e2e(a.dtypes.split(","), a.rounds, a.new_tokens)
        out = a.out if a.out != RESULTS else RESULTS.with_name("compiled_e2e.json")
        out.write_text(json.dumps({"command": " ".join(sys.argv[1:]), "prompt": E2E_PROMPT, "rows": rows,
                                   "load_before": load, "load_after": os.getloadavg()}, indent=1) + "\n")  # fmt: skip
        print(json.dumps({r["dtype"]: r["ratio"] for r in rows}))
        return
    rows = []
    load = os.getloadavg()
    for threads in (int(x) for x in a.threads.split(",")):
        for dtype in a.dtypes.split(","):
            for layers in (int(x) for x in a.blocks.split(",")):
                cmd = [sys.executable, __file__, "--one", f"{threads}/{dtype}/{layers}",
                       "--rounds", str(a.rounds), "--steps", str(a.steps), "--chunks", a.chunks]
                cmd += ["--prefill"] if a.prefill else []  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                print(f"{threads} thread(s) {dtype} {layers} layers: compiled/eager {row['ratio']} "
                      f"(paired {row['paired_ratio_median']}; eager {row['eager_median']} "
                      f"compiled {row['compiled_median']} steps/s; compile {row['compile_s']} s; chunks "
                      f"{ {T: c['ratio'] for T, c in row['chunks'].items()} }; prefill "
                      f"{row['prefill'] and row['prefill']['ratio']})", file=sys.stderr)
    res = {
        "machine": {"cpu": platform.processor() or platform.machine(), "native_bf16": cpu_has_native_bf16(),
                    "torch": torch.__version__},
        "command": " ".join(sys.argv[1:]), "rows": rows, "load_before": load, "load_after": os.getloadavg(),
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({f"{r['threads']}t/{r['dtype']}/{r['layers']}L": r["ratio"] for r in rows}))


if __name__ == "__main__":
    main()
