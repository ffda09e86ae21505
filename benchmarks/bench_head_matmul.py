"""The LM head's matmul for one decode token: dense bf16 ``F.linear``, int8 through torch's packed
kernel (quant_formats.Packed.int8, ``int8pack``) and int8 through fbgemm's dynamic linear
(quant_dynamic.DynamicInt8, ``fbgemm_dynamic``: what ``run --quant auto`` holds a Q8_0-stored head
in on x86-64; its reduce_range as this CPU needs it).

    .venv/bin/python benchmarks/bench_head_matmul.py [--threads 1] [--rounds 7] [--accuracy]

Shapes: 262144x640 (Gemma-3-270M's tied head) and 49152x576 (SmolLM2-135M's). Random weights (the
kernels' time does not depend on the values); the two are alternated within each round, 5 calls
each, medians over rounds. Results: benchmarks/results/head_matmul.json, with the load average.
Ratios: dense ÷ int8pack, int8pack ÷ fbgemm_dynamic. ``--accuracy`` also decodes 64 greedy tokens of
Gemma-3-270M (bf16, int8 layers, dense head) and puts each step's hidden row through every int8 head
(teacher forcing): the largest logit error as a fraction of that row's dense range, and at how many
steps each head's top token is the dense head's (with the dense top-2 margin where it is not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.model.capability import dynamic_reduce_range, probe  # noqa: E402
from swarm.model.quant_dynamic import DynamicInt8, fbgemm_available  # noqa: E402
from swarm.model.quant_formats import Packed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "head_matmul.json"
SHAPES = {"gemma3-270m": (262144, 640), "smollm2": (49152, 576)}


def measure(n: int, k: int, rounds: int) -> dict[str, object]:
    """Medians (ms) of one token through an (N, K) head, dense bf16, int8pack and fbgemm, alternated."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    dense = w.to(torch.bfloat16)
    spec, q, s = Packed.int8(w, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = {"dense_bf16": lambda: F.linear(x, dense), spec.kernel: lambda: spec.matmul(x, q, s)}
    if fbgemm_available():
        dyn = DynamicInt8(q, s.float(), reduce_range=dynamic_reduce_range(probe(torch.device("cpu"))))
        calls["fbgemm_dynamic"] = lambda: dyn.matmul(x)
    ms: dict[str, list[float]] = {c: [] for c in calls}
    for f in calls.values():
        f()  # warm
    for _ in range(rounds):
        for c, f in calls.items():
            t = time.perf_counter()
            for _ in range(5):
                f()
            ms[c].append((time.perf_counter() - t) / 5 * 1e3)
    med = {c: round(statistics.median(v), 2) for c, v in ms.items()}
    row: dict[str, object] = {"shape": [n, k], "ms_median": med,
                              "dense_over_int8": round(med["dense_bf16"] / med[spec.kernel], 2)}  # fmt: skip
    if "fbgemm_dynamic" in med:
        row["int8pack_over_fbgemm"] = round(med[spec.kernel] / med["fbgemm_dynamic"], 2)
    return row


def accuracy(new: int = 64) -> dict[str, object]:
    """Each int8 head kernel's logits beside the dense head's on Gemma-3-270M's own greedy rows."""
    from swarm.model.generate import LocalModel
    from swarm.model.packaged import gemma_gguf_path
    from swarm.model.stage import Head

    lm = LocalModel.load(gemma_gguf_path(), dtype=torch.bfloat16, quant="int8")
    kernels = ["int8pack", *(["fbgemm_dynamic"] if fbgemm_available() else [])]
    heads = {}
    for kernel in kernels:
        hd = Head(lm.head.args, lm.head.embed_tokens, lm.head.norm, lm.head.lm_head, lm.head.softcap)
        hd.hold_head_int8(kernel)
        heads[kernel] = hd
    session, rows, x = lm.open_session(64 + new), [], torch.tensor([100 + (i * 37) % 5000 for i in range(64)])
    with torch.inference_mode():
        for _ in range(new):
            h = lm.head.embed(x)
            for st in lm.stages:
                h = st.forward(session, h)
            rows.append(h[-1:])
            x = lm.head.logits(h[-1:])[0].argmax()[None]
        want = torch.cat([lm.head.logits(r) for r in rows])  # (new, V)
        span = want.amax(1) - want.amin(1)
        top2 = want.topk(2, 1).values
        out: dict[str, object] = {"steps": new}
        for kernel, hd in heads.items():
            got = torch.cat([hd.logits(r) for r in rows])  # each row alone, as a decode step is
            differ = got.argmax(1) != want.argmax(1)
            out[kernel] = {"max_err_over_range": round(float(((got - want).abs().amax(1) / span).max()), 4),
                           "top1_equal_steps": int((~differ).sum()),
                           "dense_margin_where_differ": [float(m) for m in (top2[:, 0] - top2[:, 1])[differ]]}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--accuracy", action="store_true", help="also each int8 head's logits on Gemma-3-270M")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    table = {name: measure(n, k, a.rounds) for name, (n, k) in SHAPES.items()}
    cap = probe(torch.device("cpu"))
    out = {"what": "one token through the LM head, ms: dense bf16, int8pack, fbgemm_dynamic", "threads": a.threads,
           "cpu": {"native_bf16": cap.native_bf16, "fbgemm": cap.fbgemm, "vnni": cap.vnni},
           "rounds": a.rounds, "loadavg_before": load0, "loadavg_after": os.getloadavg(), "results": table}  # fmt: skip
    if a.accuracy:
        out["accuracy_gemma3_270m"] = accuracy()
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
