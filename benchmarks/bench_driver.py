"""The decode driver's own cost: one-box ``generate`` on this tree ÷ the same on an older revision.

Issue 24 made the one-box loop and the coordinator's one driver (swarm/model/driver.py, a
generator of steps). This measures what that costs where it shows most: a tiny checkpoint (4
layers, dim 64, fp32, one thread), whose forward is so cheap that the loop around it is a large
part of each token. Each child process loads the model once, warms up, then times ``--runs``
generations of ``--new-tokens`` greedy tokens (plain, and with prompt lookup) and prints the
best tokens/s of them (the run least disturbed by the other work on a shared machine); the parent alternates the two trees (base, this, this, base per repeat) and
reports this ÷ base per workload (medians of the per-repeat ratios), the time per token spent
outside the target's forwards (the decoder, the drafter and the loop: what the driver could have
made slower; the best run of each child, medians), and whether both trees gave the same tokens
(they must: the schedule is unchanged).

    python benchmarks/bench_driver.py --baseline de69e93
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "driver.json"
PROMPT = [5, 9, 33, 2, 71, 5, 9, 33, 100, 4, 17, 5, 9, 33, 2, 71]


def child(ckpt_dir: str, new_tokens: int, runs: int) -> None:
    """Runs in the tree on PYTHONPATH: prints {workload: [median tok/s, output ids]} as JSON."""
    import torch

    from swarm.model.drafters import NgramDrafter
    from swarm.model.generate import LocalModel, generate

    torch.set_num_threads(1)
    model = LocalModel.load(ckpt_dir, stages=2, dtype=torch.float32)
    in_forward = [0.0]  # seconds inside the target's forwards: the rest of a run is the loop's
    run_chunk = model.run_chunk

    def timed(session: object, chunk: object) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return run_chunk(session, chunk)  # type: ignore[arg-type]
        finally:
            in_forward[0] += time.perf_counter() - t

    model.run_chunk = timed  # type: ignore[method-assign]
    out: dict[str, object] = {}
    for name in ("plain", "ngram"):
        def once(name: str = name) -> tuple[float, float, list[int]]:
            drafter = NgramDrafter() if name == "ngram" else None
            in_forward[0] = 0.0
            t = time.perf_counter()
            r = generate(model, PROMPT, max_new_tokens=new_tokens, eos_token_ids=(), drafter=drafter)
            wall = time.perf_counter() - t
            return new_tokens / wall, 1e6 * (wall - in_forward[0]) / new_tokens, r.output_token_ids

        once()  # warm
        rates, loop_us, ids = [], [], []
        for _ in range(runs):
            rate, us, ids = once()
            rates.append(rate)
            loop_us.append(us)
        out[name] = [max(rates), min(loop_us), ids]
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="de69e93", help="the revision to compare with (git archive of swarm/)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--child", nargs=3, metavar=("CKPT", "NEW", "RUNS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]))
        return
    sys.path.insert(0, str(ROOT))
    from swarm.testing.checkpoints import TinySpec, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline, "swarm"], check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        ckpt = write_checkpoint(Path(tmp) / "ckpt", TinySpec(family="llama", n_layers=4, vocab_size=128), seed=11)
        trees = {"base": base, "this": ROOT}
        samples: dict[str, dict[str, list[float]]] = {t: {"plain": [], "ngram": []} for t in trees}
        loop_us: dict[str, dict[str, list[float]]] = {t: {"plain": [], "ngram": []} for t in trees}
        ids: dict[str, dict[str, list[int]]] = {}
        for _ in range(a.repeats):
            for tree in ("base", "this", "this", "base"):
                env = {**os.environ, "PYTHONPATH": str(trees[tree])}
                got = json.loads(subprocess.run(
                    [sys.executable, __file__, "--child", str(ckpt), str(a.new_tokens), str(a.runs)],
                    env=env, check=True, capture_output=True, text=True).stdout)  # fmt: skip
                for w, (rate, us, out) in got.items():
                    samples[tree][w].append(rate)
                    loop_us[tree][w].append(us)
                    ids.setdefault(tree, {})[w] = out
    result = {
        "what": "one-box generate tok/s on a tiny fp32 checkpoint (4 layers, 2 stages, 1 thread): this tree / baseline",
        "baseline": a.baseline,
        "host": platform.node(), "machine": platform.machine(), "load_avg": os.getloadavg(),
        "new_tokens": a.new_tokens, "runs": a.runs, "repeats": a.repeats,
        "same_tokens": ids["this"] == ids["base"],
    }  # fmt: skip
    for w in ("plain", "ngram"):
        this, base_ = samples["this"][w], samples["base"][w]
        ratios = [this[2 * i] / base_[2 * i] for i in range(a.repeats)] + [
            this[2 * i + 1] / base_[2 * i + 1] for i in range(a.repeats)]  # fmt: skip
        result[w] = {"this_tok_s": round(statistics.median(this), 1), "base_tok_s": round(statistics.median(base_), 1),
                     "ratio_median": round(statistics.median(ratios), 3),
                     # per new token, outside the target's forwards (decoder, drafter, driver loop)
                     "this_loop_us": round(statistics.median(loop_us["this"][w]), 1),
                     "base_loop_us": round(statistics.median(loop_us["base"][w]), 1),
                     "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
