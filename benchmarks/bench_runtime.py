"""Runtime benchmark on the bundled model, measured side by side in one run (medians).

    .venv/bin/python benchmarks/bench_runtime.py [--threads 1] [--new-tokens 48] [--repeats 3]

Ratios written to benchmarks/results/runtime.json:

- ours_vs_transformers: our 1-stage greedy decode tok/s / transformers ``generate`` decode tok/s
  (bf16, same threads; decode = time(N new tokens) - time(1 new token), both sides).
- stages_vs_one: N-stage in-process decode tok/s / 1-stage decode tok/s.
- verify_k{4,8}: time of one verify chunk ([pending] + K drafts, K+1 rows) / one-token step.
- drafts_bf16 / fp32.drafts: per drafter (K = 4), accepted drafted tokens per round, acceptance
  rate, and decode tok/s / plain decode tok/s.
- fp32: the same model in fp32 (on CPUs without native bf16, fp32 is the faster dtype).
- layers_vs_handwritten (bf16 and fp32): one whole-model Stage of transformers' decoder layers
  against the hand-written Llama layers (swarm/model/llama_layers.py),
  same weights, dtype and threads, timed alternately on the same chunks after the prompt: time
  ratio transformers / hand-written for a decode step (1 row) and verify chunks (5 and 9 rows);
  below 1.05 would have been "within 5%" (one runtime); see llama_layers.py for the decision.
  ``--compare-only`` runs just this part and writes benchmarks/results/runtime_layers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from swarm.model.bundled import BUNDLED_NAME, default_model_dir
from swarm.model.drafters import NgramDrafter, self_draft_layers, self_drafter
from swarm.model.generate import LocalModel, generate
from swarm.model.speculative import KPolicy, VerifyChunk
from swarm.model.tokenizer import Tokenizer

PROMPTS = [
    "Explain how a binary search works, with Python code.",
    "List three benefits of regular exercise.",
    "Write a short poem about the sea.",
]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def hf_decode_tps(hf: Any, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=2, eos_token_id=None)

    def timed(k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=k, min_new_tokens=k, **kw)
        assert out.shape[1] == len(ids) + k
        return time.perf_counter() - t

    return (n - 1) / (timed(n) - timed(1))


def layers_vs_handwritten(path: Path, ids: list[int], dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Paired per-chunk time ratios: transformers' layers (Stage) / hand-written layers."""
    from swarm.model.stage import Head, Stage
    from swarm.model.weights import open_checkpoint

    ck = open_checkpoint(path)
    head = Head.load(ck.args, ck.source, dtype=dtype)
    ours = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=dtype, runtime="transformers")
    base = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=dtype, runtime="handwritten")
    h = head.embed(torch.tensor(ids))
    outs = []
    for st in (ours, base):
        st.open_session("b", 512)
        outs.append(st("b", h))
    rows: dict[str, Any] = {}
    for t in (1, 5, 9):
        x = h[:t]
        ratios, t_ours, t_base = [], [], []
        for _ in range(15 * repeats):
            times = []
            for st in (ours, base):
                t0 = time.perf_counter()
                st("b", x)
                times.append(time.perf_counter() - t0)
                st.rollback("b", len(ids))
            ratios.append(times[0] / times[1])
            t_ours.append(times[0])
            t_base.append(times[1])
        rows[f"rows{t}"] = {
            "transformers_ms": round(1000 * median(t_ours), 3),
            "handwritten_ms": round(1000 * median(t_base), 3),
            "ratio": round(median(ratios), 3),
        }
    rows["prefill_max_abs_diff"] = float((outs[0].float() - outs[1].float()).abs().max())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/runtime.json")
    ap.add_argument("--compare-only", action="store_true", help="only layers_vs_handwritten")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    compare = {
        "bf16": layers_vs_handwritten(path, prompts[0], torch.bfloat16, a.repeats),
        "fp32": layers_vs_handwritten(path, prompts[0], torch.float32, a.repeats),
    }
    if a.compare_only:
        result_c = {"model": BUNDLED_NAME, "threads": a.threads, "repeats": a.repeats,
                    "layers_vs_handwritten": compare}
        out_c = Path(a.out).with_name("runtime_layers.json")
        out_c.write_text(json.dumps(result_c, indent=2) + "\n")
        print(json.dumps(result_c, indent=2))
        return
    one = LocalModel.load(path, stages=1, dtype=torch.bfloat16)
    split = LocalModel.load(path, stages=a.stages, dtype=torch.bfloat16)
    from transformers import AutoModelForCausalLM  # the reference: benchmarks/tests only

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    n = a.new_tokens
    ids = prompts[0]

    ours, theirs, staged = [], [], []
    for _ in range(a.repeats):  # interleaved so load changes hit all sides alike
        ours.append(generate(one, ids, max_new_tokens=n, eos_token_ids=()).decode_tokens_per_s)
        theirs.append(hf_decode_tps(hf, ids, n))
        staged.append(generate(split, ids, max_new_tokens=n, eos_token_ids=()).decode_tokens_per_s)
    ours16 = generate(one, ids, max_new_tokens=16, eos_token_ids=()).output_token_ids
    hf16 = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                       do_sample=False, pad_token_id=2)[0, len(ids):].tolist()

    def verify_costs(model: LocalModel) -> dict[int, float]:
        """Median seconds of a chunk of 1, 5 and 9 rows after the prompt's context."""
        session = model.open_session(512)
        model.run_chunk(session, VerifyChunk(0, 0, tuple(ids), len(ids) - 1, True))
        costs: dict[int, list[float]] = {1: [], 5: [], 9: []}
        for _ in range(7 * a.repeats):
            for t in costs:
                t0 = time.perf_counter()
                model.run_chunk(session, VerifyChunk(1, len(ids), tuple(ids[:t]), 0, False))
                costs[t].append(time.perf_counter() - t0)
        model.close_session(session)
        return {t: median(v) for t, v in costs.items()}

    def draft_rows(model: LocalModel, dtype: torch.dtype) -> dict[str, Any]:
        drafts: dict[str, Any] = {}
        for name in ("ngram", "self"):
            rows = []
            for p in prompts:
                plain = generate(model, p, max_new_tokens=n, eos_token_ids=())
                drafter = (NgramDrafter() if name == "ngram" else
                           self_drafter(model.head, model.ckpt, dtype=dtype, max_len=512))
                r = generate(model, p, max_new_tokens=n, eos_token_ids=(), drafter=drafter,
                             policy=KPolicy(fixed_k=4))
                rows.append((r.accepted_per_round or 0.0, r.acceptance_rate or 0.0,
                             r.decode_tokens_per_s / plain.decode_tokens_per_s,
                             r.output_token_ids == plain.output_token_ids))
            drafts[name] = {
                "layers": self_draft_layers(model.args.n_layers) if name == "self" else None,
                "k": 4,
                "accepted_per_round": round(median([r[0] for r in rows]), 3),
                "acceptance_rate": round(median([r[1] for r in rows]), 3),
                "speedup_vs_plain": round(median([r[2] for r in rows]), 3),
                "greedy_identical_to_plain": all(r[3] for r in rows),
            }
        return drafts

    # Step-level pairing: one decode step on the split model, then on the whole, many times.
    s1, sn = one.open_session(512), split.open_session(512)
    for m, s_ in ((one, s1), (split, sn)):
        m.run_chunk(s_, VerifyChunk(0, 0, tuple(ids), len(ids) - 1, True))
    pairs = []
    for _ in range(15 * a.repeats):
        t0 = time.perf_counter()
        one.run_chunk(s1, VerifyChunk(1, len(ids), (ids[0],), 0, False))
        t1 = time.perf_counter()
        split.run_chunk(sn, VerifyChunk(1, len(ids), (ids[0],), 0, False))
        t2 = time.perf_counter()
        pairs.append((t1 - t0) / (t2 - t1))
    step_ratio = median(pairs)  # N-stage tok/s / 1-stage tok/s
    one.close_session(s1)
    split.close_session(sn)

    cost_bf16 = verify_costs(one)
    drafts_bf16 = draft_rows(one, torch.bfloat16)
    del split
    one32 = LocalModel.load(path, stages=1, dtype=torch.float32)
    fp32_tps = median([generate(one32, ids, max_new_tokens=n, eos_token_ids=()).decode_tokens_per_s
                       for _ in range(a.repeats)])
    cost_fp32 = verify_costs(one32)
    drafts_fp32 = draft_rows(one32, torch.float32)
    c1 = cost_bf16[1]

    result = {
        "model": BUNDLED_NAME, "dtype": "bf16", "threads": a.threads, "new_tokens": n,
        "layers_vs_handwritten": compare,
        "prompt_tokens": len(ids), "repeats": a.repeats,
        "ours_decode_tok_s": round(median(ours), 2),
        "transformers_decode_tok_s": round(median(theirs), 2),
        # paired: the ratio of each interleaved repeat, then the median (load on a shared
        # machine swings both sides of a pair alike)
        "ours_vs_transformers": round(median([x / y for x, y in zip(ours, theirs, strict=True)]), 3),
        "greedy_matches_transformers_16_tokens": ours16 == hf16,
        "ours_16": ours16, "transformers_16": hf16,
        f"stages{a.stages}_decode_tok_s": round(median(staged), 2),
        "stages_vs_one": round(median([x / y for x, y in zip(staged, ours, strict=True)]), 3),
        "stages_vs_one_step_paired": round(step_ratio, 3),
        "one_token_step_ms": round(1000 * c1, 2),
        "verify_k4_vs_one": round(cost_bf16[5] / c1, 3),
        "verify_k8_vs_one": round(cost_bf16[9] / c1, 3),
        "drafts_bf16": drafts_bf16,
        "fp32": {
            "decode_tok_s": round(fp32_tps, 2),
            "fp32_vs_bf16_decode": round(fp32_tps / median(ours), 3),
            "one_token_step_ms": round(1000 * cost_fp32[1], 2),
            "verify_k4_vs_one": round(cost_fp32[5] / cost_fp32[1], 3),
            "verify_k8_vs_one": round(cost_fp32[9] / cost_fp32[1], 3),
            "drafts": drafts_fp32,
        },
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
