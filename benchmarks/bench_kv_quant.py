"""KV cache quantization (the invite's ``kv_cache``) on the bundled SmolLM2-135M, side by side.

- ``bytes``: a session's KV cache at the context after a prefill, int8 (and fp8) ÷ the same
  cache in bf16, counted from the tensors the stage allocated (target ≈ 0.5), and the planner's
  per-token figure (swarm.model.kvcache.kv_bytes_per_token_per_layer) beside it.
- ``perplexity``: over a text no one here wrote (the Apache-2.0 licence shipped in transformers'
  dist-info, as bench_quant.py), windows of ``--window`` tokens, each window prefilled in chunks of
  ``--chunk`` tokens so later chunks attend to keys and values read back from the cache (a single
  whole-window chunk would too: update() returns the chunk's own entries quantized). int8 / fp8 ÷
  the unquantized cache in the same dtype (target ≤ 1.01).
- ``decode``: greedy decode tokens/s after a prompt of ``--prompt`` tokens, int8 / fp8 ÷ auto,
  the formats alternated (auto, int8, fp8, fp8, int8, auto per repeat), medians; one thread.

The same loaded stages serve every format: a stage's ``kv_cache`` is read when a session opens.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "kv_quant.json"

from swarm.model.bundled import default_model_dir  # noqa: E402
from swarm.model.dtypes import cpu_has_native_bf16  # noqa: E402
from swarm.model.generate import LocalModel, generate  # noqa: E402
from swarm.model.kvcache import kv_bytes_per_token_per_layer  # noqa: E402
from swarm.model.tokenizer import Tokenizer  # noqa: E402

FORMATS = ("auto", "int8", "fp8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def use(lm: LocalModel, fmt: str) -> LocalModel:
    for st in lm.stages:
        st.kv_cache = fmt
    return lm


@torch.inference_mode()
def cache_bytes(lm: LocalModel, fmt: str, ids: list[int], context: int) -> int:
    use(lm, fmt)
    s = lm.open_session(context)
    try:
        h = lm.head.embed(torch.tensor(ids))
        for st in lm.stages:
            h = st(s, h)
        return sum(st._cache(s).nbytes() for st in lm.stages)
    finally:
        lm.close_session(s)


@torch.inference_mode()
def perplexity(lm: LocalModel, fmt: str, ids: list[int], window: int, chunk: int) -> float:
    use(lm, fmt)
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        part = ids[start : start + window + 1]
        if len(part) < 2:
            break
        s = lm.open_session(len(part))
        try:
            for a in range(0, len(part) - 1, chunk):
                x, y = part[a : min(a + chunk, len(part) - 1)], part[a + 1 : min(a + chunk, len(part) - 1) + 1]
                h = lm.head.embed(torch.tensor(x))
                for st in lm.stages:
                    h = st(s, h)
                logits = lm.head.logits(h)  # (T, V) float32
                nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="sum"))
                n += len(y)
        finally:
            lm.close_session(s)
    return math.exp(nll / n)


def _licence() -> Path:
    return Path(str(importlib.metadata.distribution("transformers").locate_file("transformers-"
                f"{importlib.metadata.version('transformers')}.dist-info/licenses/LICENSE")))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="compute dtype (perplexity and decode)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text for perplexity")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens before the decode is timed")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1 repeat, prompt 256")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.window, a.repeats, a.prompt, a.new_tokens = 512, 512, 1, 256, 16
    torch.set_num_threads(a.threads)
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    lic = _licence()
    text_ids = tok.encode(lic.read_text(encoding="utf-8"))
    res: dict[str, object] = {
        "model": model_dir.name, "dtype": a.dtype, "threads": a.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "native_bf16": cpu_has_native_bf16(),
                    "torch": torch.__version__},
    }  # fmt: skip

    # bytes: the caches the stages allocated, in bf16 (the unit the issue names), at the context
    bf = LocalModel.load(model_dir, stages=1, dtype=torch.bfloat16)
    ctx = 512
    nb = {f: cache_bytes(bf, f, text_ids[:ctx], ctx) for f in FORMATS}
    del bf
    res["bytes"] = {
        "context": ctx, "kv_bytes": nb,
        "int8_over_bf16": nb["int8"] / nb["auto"], "fp8_over_bf16": nb["fp8"] / nb["auto"],
    }  # fmt: skip
    print(json.dumps(res["bytes"]), flush=True)

    lm = LocalModel.load(model_dir, stages=1, dtype=DTYPES[a.dtype])
    per = {f: kv_bytes_per_token_per_layer(lm.args, f, 2) for f in FORMATS}
    res["bytes"]["planner_per_token_per_layer_at_2_bytes"] = per  # type: ignore[index]
    res["bytes"]["planner_int8_over_bf16"] = per["int8"] / per["auto"]  # type: ignore[index]

    ids = text_ids[: a.tokens + 1]
    t0 = time.perf_counter()
    ppl = {f: perplexity(lm, f, ids, a.window, a.chunk) for f in FORMATS}
    res["perplexity"] = {
        "text": f"{lic.relative_to(lic.parents[2])} ({len(ids) - 1} tokens predicted, windows of {a.window}, "
                f"prefilled in chunks of {a.chunk})",
        "dtype": a.dtype, "perplexity": ppl,
        "int8_over_unquantized": ppl["int8"] / ppl["auto"], "fp8_over_unquantized": ppl["fp8"] / ppl["auto"],
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    print(json.dumps(res["perplexity"]), flush=True)

    prompt = text_ids[: a.prompt]
    runs: dict[str, list[float]] = {f: [] for f in FORMATS}
    order = [*FORMATS, *reversed(FORMATS)]
    for _ in range(a.repeats):
        for f in order:
            r = generate(use(lm, f), prompt, max_new_tokens=a.new_tokens, eos_token_ids=())
            runs[f].append(r.decode_tokens_per_s)
    med = {f: statistics.median(v) for f, v in runs.items()}
    res["decode"] = {
        "prompt_tokens": a.prompt, "new_tokens": a.new_tokens, "tok_s": runs, "median_tok_s": med,
        "int8_over_unquantized": med["int8"] / med["auto"], "fp8_over_unquantized": med["fp8"] / med["auto"],
        "note": "the quantized formats dequantize every cached position of a layer at every step (update() "
                "returns the whole cache in the compute dtype), so decode pays O(context) extra work per layer",
    }  # fmt: skip
    print(json.dumps(res["decode"]), flush=True)
    res["gpu"] = "not measured here (CPU only)"
    res["command"] = "python benchmarks/bench_kv_quant.py " + " ".join(sys.argv[1:])
    res["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
