"""The stage's layer loop, this tree against another, alternated call by call in one process.

    .venv/bin/python benchmarks/bench_forward.py [--baseline REV | --against DIR] [--calls 100]

The other tree is ``swarm/`` at revision REV (``git archive``; default 8750c7f, main before the
one layer loop, issue 24), or the ``swarm`` package under DIR. Both
packages are imported into this one process (each is imported and then taken out of
``sys.modules``; its modules keep working through the names they bound), each loads a 30-layer
stage of the bundled model (bf16, 1 thread), twice, in the order A B B A (whichever is loaded
first ran 1-2% slower in A/A runs here), and the pairs (A1, B1) and (A2, B2) are timed call by
call in turn (A B, then B A), so a change in the machine's load falls on both sides of a pair:

- decode: ``Stage.forward`` of one token on one session (the hot path);
- batch4: ``forward_many`` of one token on each of 4 sessions (several sessions, one pass);
- replay16: ``Stage.forward_seq`` of 16 one-token chunks of one session (a replay after a loss).

The figure per kind is the median over pairs of this tree's time / the other's, after 6 warm-up
pairs (``--calls`` pairs of each of the two). Written to benchmarks/results/forward.json with the
load average. Run it ``--against`` a copy of this same tree to see the noise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarm.model.bundled import default_model_dir
from swarm.model.weights import open_checkpoint

HERE = Path(__file__).resolve().parents[1]
KINDS = ("decode", "batch4", "replay16")


def import_tree(tree: Path) -> tuple[Any, Any]:
    """(the Stage class, forward_many) of the ``swarm`` package under ``tree``, imported apart."""
    before = {k: v for k, v in sys.modules.items() if k == "swarm" or k.startswith("swarm.")}
    for k in before:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        batched = importlib.import_module("swarm.model.batched")
        stage = importlib.import_module("swarm.model.stage")
        assert Path(str(stage.__file__)).resolve().is_relative_to(tree.resolve()), stage.__file__
        return stage.Stage, batched.forward_many
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "swarm" or k.startswith("swarm.")]:
            del sys.modules[k]
        sys.modules.update(before)


def setup(stage_cls: Any, forward_many: Any, calls: int) -> dict[str, Callable[[], object]]:
    """One 30-layer stage of the bundled model with its sessions: each kind as a call."""
    ck = open_checkpoint(default_model_dir())
    stage = stage_cls.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(32, ck.args.dim, generator=gen).to(torch.bfloat16)
    for s in ("one", "a", "b", "c", "d", "seq"):
        stage.open_session(s, 32 + calls + 64)
        stage.forward(s, prompt)
    h = torch.randn(1, ck.args.dim, generator=gen).to(torch.bfloat16)
    return {
        "decode": lambda: stage.forward("one", h),
        "batch4": lambda: forward_many(stage, [(s, h) for s in "abcd"]),
        "replay16": lambda: stage.forward_seq("seq", [(32 + k, h) for k in range(16)]),
    }


def timed(call: Callable[[], object]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", default="8750c7f", help="the revision to compare with (git archive of swarm/)")
    p.add_argument("--against", type=Path, help="a folder holding the other swarm package (instead of --baseline)")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "forward.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.against is None:
            archive = subprocess.run(["git", "-C", str(HERE), "archive", a.baseline, "swarm"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        result = measure(a.against or Path(tmp), a.calls)
    result["against"] = str(a.against) if a.against else f"revision {a.baseline}"
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def measure(other_tree: Path, calls: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    n = calls + 3
    trees = import_tree(HERE), import_tree(other_tree)
    # stages loaded A, B, B, A and paired (A1, B1), (A2, B2): whichever stage is loaded first
    # measured ~1-2% slower in A/A runs here (memory placement), which this order cancels
    a1, b1 = setup(*trees[0], n), setup(*trees[1], n)
    b2, a2 = setup(*trees[1], n), setup(*trees[0], n)
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in KINDS}
    for i in range(2 * n):
        mine, other = (a1, b1) if i % 2 == 0 else (a2, b2)
        for k in KINDS:
            if i % 4 < 2:
                t_mine, t_other = timed(mine[k]), timed(other[k])
            else:
                t_other, t_mine = timed(other[k]), timed(mine[k])
            if i >= 6:
                ratios[k].append(t_mine / t_other)
                times[k][0].append(t_mine)
                times[k][1].append(t_other)
    return {
        "what": "time per call, this tree / the other tree, median over pairs alternated call by call "
                "in one process, stages loaded A B B A; 30-layer stage of the bundled model, bf16, 1 thread",
        "calls": calls,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "ratio": {k: round(statistics.median(v), 4) for k, v in ratios.items()},
        "ms_this": {k: round(1000 * statistics.median(v[0]), 3) for k, v in times.items()},
        "ms_other": {k: round(1000 * statistics.median(v[1]), 3) for k, v in times.items()},
    }


if __name__ == "__main__":
    main()
