"""Resident memory of a stage holding a quarter of the layers ÷ that of the whole model.

Each measurement runs in a fresh subprocess: import torch and open the checkpoint (headers only),
read RSS, load the part, run one forward so every page is touched, release the checkpoint's file
mappings, read RSS again. The delta is what the part costs a node. The whole model is all layers
plus the head (embedding, norm, LM head); the quarter is a Stage of the first round(L/4) layers
with no head, as a ring peer holds it. ``ideal`` is the same ratio from ModelArgs' byte counts.

    .venv/bin/python benchmarks/bench_stage_memory.py [--model DIR] [--repeats 3] [--dtype bf16]

Uses the bundled SmolLM2-135M (converted on first use) unless --model is given; if the bundled
model is unavailable, a larger random checkpoint written to a temp dir. Prints and writes
benchmarks/results/stage_memory.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "stage_memory.json"

CHILD = r"""
import gc, json, sys, torch
torch.set_num_threads(1)
from swarm.model.stage import Head, Stage
from swarm.model.weights import open_checkpoint

def rss():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "RssAnon", "RssFile")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out

model, start, end, with_head, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
ck = open_checkpoint(model)
gc.collect()
before = rss()
stage = Stage.load(ck.args, ck.source, start, end, dtype=dt)
head = Head.load(ck.args, ck.source, dtype=dt) if with_head else None
stage.open_session(0, 16)
h = head.embed(torch.tensor([1, 2, 3])) if head else torch.zeros(3, ck.args.dim, dtype=dt)
h = stage(0, h)
if head:
    head.logits(h[-1:])
stage.close_session(0)
close = getattr(ck.source, "close", None)
if close:
    close()
del ck
gc.collect()
after = rss()
print(json.dumps({k: after[k] - before[k] for k in after}))
"""


def measure(model: Path, start: int, end: int, head: bool, dtype: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(start), str(end), "1" if head else "0", dtype],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def fallback_model() -> Path:
    import torch

    from swarm.testing.checkpoints import TinySpec, write_checkpoint

    d = Path(tempfile.mkdtemp(prefix="bench-stage-mem-"))
    spec = TinySpec(family="llama", n_layers=16, dim=512, n_heads=8, n_kv_heads=4,
                    intermediate_size=1536, vocab_size=8192)
    return write_checkpoint(d, spec, seed=0, dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from swarm.model.config import ModelArgs

    model, source = a.model, "given"
    if model is None:
        try:
            from swarm.model.bundled import BUNDLED_NAME, default_model_dir

            model, source = default_model_dir(), BUNDLED_NAME
        except Exception as e:  # no bundled model here: measure a random checkpoint instead
            print(f"bundled model unavailable ({e}); using a random checkpoint", file=sys.stderr)
            model, source = fallback_model(), "random-16x512"
    args = ModelArgs.from_dir(model)
    L = args.n_layers
    q = max(1, round(L / 4))
    whole, quarter = [], []
    for _ in range(a.repeats):  # interleaved, so drift in the machine's load hits both alike
        whole.append(measure(model, 0, L, True, a.dtype))
        quarter.append(measure(model, 0, q, False, a.dtype))
    b = 2 if a.dtype == "bf16" else 4
    ideal = q * args.layer_bytes(b) / (L * args.layer_bytes(b) + args.head_bytes(b))

    def med(rows: list[dict[str, int]], key: str) -> int:
        return int(statistics.median(r[key] for r in rows))

    result = {
        "model": source,
        "dtype": a.dtype,
        "n_layers": L,
        "quarter_layers": q,
        "repeats": a.repeats,
        "whole_rss_bytes": med(whole, "VmRSS"),
        "quarter_rss_bytes": med(quarter, "VmRSS"),
        "whole_anon_bytes": med(whole, "RssAnon"),
        "quarter_anon_bytes": med(quarter, "RssAnon"),
        "ratio_rss": med(quarter, "VmRSS") / med(whole, "VmRSS"),
        "ratio_anon": med(quarter, "RssAnon") / med(whole, "RssAnon"),
        "ideal_ratio_from_weights": ideal,
        "note": "whole = all layers + head; quarter = Stage of the first round(L/4) layers, no head",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
