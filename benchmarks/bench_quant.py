"""Weight-only int8 / int4 against the serving dtype on the bundled SmolLM2-135M, side by side.

    .venv/bin/python benchmarks/bench_quant.py [--threads 1] [--repeats 3] [--new-tokens 24] [--quick]

Reports, into benchmarks/results/quant.json:

- ``resident``: bytes of all 30 layers' weights (parameters + compact buffers) under int8 / int4
  ÷ bf16 (targets ≤ 0.55 / ≤ 0.30), and int4 at group sizes 32 / 64 / 128 (the choice).
- ``gguf_load``: a fresh process loads all 30 layers from the bundled Q4_1 GGUF as int4 (blocks
  repacked, no float copy) and, for comparison, from the converted safetensors (bf16 loaded one
  layer at a time, then quantized): peak RSS growth (VmHWM) ÷ the block's final compact bytes, and
  the peak of anonymous memory sampled every ms (the GGUF's mapped pages are file-backed).
- ``quality``: perplexity on a text no one here wrote (the Apache-2.0 licence shipped in
  transformers' dist-info), windows of 512 tokens, int8 and int4 ÷ unquantized (targets ≤ 1.02 /
  ≤ 1.10; fp32 activations, see below); int4 per group size; greedy agreement with bf16 over 16
  chat prompts, 16 new tokens (first differing token).
- ``decode``: greedy decode tok/s, one process, same threads, int8 and int4 ÷ unquantized, in
  bf16 (the packed kernels) and fp32 (the dequantizing path), interleaved repeats, medians.
- ``moe_layer``: one decoder layer of Qwen3-30B-A3B's config (128 experts of 768 x 2048, the
  shape users pool for; random weights, no checkpoint) built in a fresh process in bf16 and
  quantized: the planner's bytes for that layer ÷ the bytes it holds (tensors) and ÷ the growth of
  the process's anonymous memory (glibc's mmap threshold fixed, as in ``gguf_load``).
- ``int4_group_by_matrix``: the int4 byte target (≤ 0.30 of bf16) needs a larger group than 32 for
  a good share of the weights (torch's int4 kernels hold a bf16 scale and zero per group). For
  each kind of matrix (q, k, v, o, gate, up, down) held at groups of 64 and of 128, the rest at
  32: perplexity (fp32 activations) ÷ all at 32 and the bytes ÷ bf16, on the bundled SmolLM2 (a
  Q4_1 model: its weights sit on a grid of 32) and on Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K
  and Q8_0 tensors) when its packages are installed.
- ``plan_70b``: ``shard-swarm plan`` for Llama-3.3-70B's config (no weights) on three 24 GB GPUs
  offering 22 GB each: refused in bf16, fits with --quant int4 (the per-peer blocks).

No GPU figure: this session had no GPU machine (see README, Quantization).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "quant.json"

from swarm.model.bundled import bundled_gguf_path, default_model_dir  # noqa: E402
from swarm.model.generate import LocalModel, generate  # noqa: E402
from swarm.model.quant import INT4_GROUP, block_nbytes, quantize_block  # noqa: E402
from swarm.model.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis briefly.",
    "List three prime numbers.", "How do I boil an egg?", "What is 12 times 7?",
    "Name a famous painter.", "Why is the sky blue?", "Translate 'thank you' into Spanish.",
    "Give me a tip for learning to code.", "What does a compiler do?", "Describe a cat in one sentence.",
    "What year did humans land on the Moon?", "Suggest a name for a dog.", "What is gravity?",
    "How many legs does a spider have?",
]  # fmt: skip

CHILD = r"""
import json, sys, threading, time, torch
torch.set_num_threads(1)
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.model.quant import block_nbytes

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out

path, quant, dtype = sys.argv[1], sys.argv[2], {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[3]]
ck = open_checkpoint(path)
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status()
peak_anon = [base["RssAnon"]]
done = threading.Event()
def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.001)
t = threading.Thread(target=sample); t.start()
stage = Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=dtype, quant=quant)
done.set(); t.join()
end = status()
print(json.dumps({"final_bytes": block_nbytes(stage), "peak_rss_growth": end["VmHWM"] - base["VmRSS"],
                  "peak_anon_growth": peak_anon[0] - base["RssAnon"], "file_pages_after": end["RssFile"] - base["RssFile"],
                  "one_layer_bf16_bytes": ck.args.layer_bytes(2)}))
"""


def gguf_load(model_dir: Path) -> dict[str, object]:
    """Each load in a fresh process, with glibc's default malloc and with its mmap threshold fixed
    at 128 KiB: by default glibc raises the threshold (up to 32 MiB) after a large free, so the
    per-tensor temporaries of a small model stay in its heap after they are freed and RSS shows
    them; with the threshold fixed RSS follows what is live. (A 70B model's tensors are hundreds
    of MB, above any threshold, so they are returned either way.)"""
    out: dict[str, object] = {"note": gguf_load.__doc__}
    for name, path in (("gguf_q4_1_to_int4", bundled_gguf_path()), ("safetensors_bf16_to_int4", model_dir)):
        for malloc, extra in (("default_malloc", {}), ("mmap_threshold_128k", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
            env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **extra}
            r = subprocess.run([sys.executable, "-c", CHILD, str(path), "int4", "bf16"], capture_output=True,
                               text=True, timeout=600, cwd=ROOT, env=env)  # fmt: skip
            if r.returncode != 0:
                raise SystemExit(r.stderr[-2000:])
            m = json.loads(r.stdout.strip().splitlines()[-1])
            m["peak_rss_over_final"] = m["peak_rss_growth"] / m["final_bytes"]
            m["peak_anon_over_final"] = m["peak_anon_growth"] / m["final_bytes"]
            out[f"{name}/{malloc}"] = m
    return out


MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
              "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
              "tie_word_embeddings": False, "hidden_act": "silu"}  # Qwen3-30B-A3B's config.json  # fmt: skip

MOE_CHILD = r"""
import gc, json, sys, torch
torch.set_num_threads(1)
from swarm.model.config import ModelArgs
from swarm.model.quant import block_nbytes, layer_bytes_each, quantize_block
from swarm.model.stage import Stage

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024

args = ModelArgs.from_config(json.loads(sys.argv[1]))
quant = sys.argv[2]
stage = Stage(args, 0, 1, dtype=torch.bfloat16)  # on meta: transformers imported, nothing allocated
base = anon()
stage = stage.to_empty(device="cpu")
with torch.no_grad():
    for p in stage.parameters():
        p.normal_(0.0, 0.02)
quantize_block(stage.layers[0], quant, dtype=torch.bfloat16)
gc.collect()
print(json.dumps({"planned": layer_bytes_each(args, quant, 2)[0], "tensor_bytes": block_nbytes(stage.layers[0]),
                  "anon_growth": anon() - base}))
"""


def moe_layer() -> dict[str, object]:
    out: dict[str, object] = {"model": "Qwen3-30B-A3B config, layer 0 (128 experts, 8 active), bf16, random weights"}
    for quant in ("none", "int8", "int4"):
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "131072"}
        r = subprocess.run([sys.executable, "-c", MOE_CHILD, json.dumps(MOE_CONFIG), quant], capture_output=True,
                           text=True, timeout=900, cwd=ROOT, env=env)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
        m = json.loads(r.stdout.strip().splitlines()[-1])
        m["planned_over_tensor_bytes"] = m["planned"] / m["tensor_bytes"]
        m["planned_over_anon_growth"] = m["planned"] / m["anon_growth"]
        out[quant] = m
    none = out["none"]["planned"]  # type: ignore[index]
    out["int8_over_bf16"] = out["int8"]["planned"] / none  # type: ignore[index]
    out["int4_over_bf16"] = out["int4"]["planned"] / none  # type: ignore[index]
    return out


def _load(model_dir: Path, dtype: torch.dtype, quant: str, group: int = INT4_GROUP) -> LocalModel:
    lm = LocalModel.load(model_dir, stages=1, dtype=dtype)
    for layer in lm.stages[0].layers:
        quantize_block(layer, quant, dtype=dtype, group=group)
    return lm


@torch.inference_mode()
def perplexity(lm: LocalModel, ids: list[int], window: int = 512) -> float:
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        s = lm.open_session(len(chunk))
        try:
            h = lm.head.embed(torch.tensor(chunk[:-1]))
            for st in lm.stages:
                h = st(s, h)
            logits = lm.head.logits(h)  # (T, V) float32
        finally:
            lm.close_session(s)
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
        n += len(chunk) - 1
    return math.exp(nll / n)


def greedy(lm: LocalModel, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [generate(lm, p, max_new_tokens=new, eos_token_ids=()).output_token_ids for p in prompts]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def plan_70b() -> dict[str, object]:
    from swarm.cli.plan import model_spec, plan_or_hint
    from swarm.errors import PlanningError
    from swarm.planner import Latency, Peer

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
           "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
           "num_hidden_layers": 80, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}  # fmt: skip
    peers = [Peer(f"gpu-{c}", 22 * 10**9, 0.8) for c in "abc"]
    lat = Latency({"gpu-a": {"gpu-b": 20.0, "gpu-c": 30.0}, "gpu-b": {"gpu-c": 25.0}})
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))

        def spec_for(q: str):  # type: ignore[no-untyped-def]
            return model_spec(model=Path(d), layers=None, layer_gb=None, coordinator_gb=None, draft_gb=0.0,
                              kv_kb_per_token=None, context=4096, dtype_bytes=2, quant=q)  # fmt: skip

        out: dict[str, object] = {}
        try:
            plan_or_hint(spec_for, "none", peers, lat)
            out["bf16"] = "fits (unexpected)"
        except PlanningError as e:
            out["bf16"] = str(e)
        p, spec = plan_or_hint(spec_for, "int4", peers, lat)
        out["int4"] = {"blocks": {k: list(v) for k, v in p.blocks.items()}, "coordinator": p.coordinator,
                       "layer_bytes": spec.layer_bytes, "bytes_per_layer_with_kv": spec.bytes_per_layer,
                       "bf16_layer_bytes": spec_for("none").layer_bytes}  # fmt: skip
        return out


ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load_groups(model: Path, groups: dict[str, int]) -> LocalModel:
    """fp32 model whose int4 linears use ``groups[role]`` (default 32) per kind of matrix."""
    from swarm.model.quant import QuantLinear, linear_paths
    from swarm.model.quant_formats import pack

    lm = LocalModel.load(model, stages=1, dtype=torch.float32)
    for layer in lm.stages[0].layers:
        for path in linear_paths(layer):
            lin = layer.get_submodule(path)
            g = groups.get(path.rsplit(".", 1)[-1], INT4_GROUP)
            layer.set_submodule(path, QuantLinear(*pack(lin.weight.detach(), "int4", torch.float32, lin.weight.device, g),
                                                  lin.bias))  # fmt: skip
    return lm


def int4_group_by_matrix(models: dict[str, Path], text: str, n_tokens: int) -> dict[str, object]:
    from swarm.model.tokenizer import Tokenizer

    out: dict[str, object] = {"note": "perplexity with fp32 activations over the first tokens of the text; "
                                      "bytes: int4 weights of all layers ÷ bf16; noisy box, single runs"}  # fmt: skip
    for name, path in models.items():
        tok = Tokenizer.load(path)
        ids = tok.encode(text, add_special_tokens=True)[: n_tokens + 1]
        bf16 = sum(block_nbytes(s) for s in LocalModel.load(path, stages=1, dtype=torch.bfloat16).stages)
        base = _load_groups(path, {})
        base_ppl = perplexity(base, ids)
        rows: dict[str, object] = {"all_32": {"perplexity": base_ppl, "bytes_over_bf16": _int4_bytes(base) / bf16}}
        del base
        for g in (64, 128):
            for role in ROLES:
                lm = _load_groups(path, {role: g})
                ppl = perplexity(lm, ids)
                rows[f"{role}@{g}"] = {"perplexity_over_all_32": ppl / base_ppl,
                                       "bytes_over_bf16": _int4_bytes(lm) / bf16}  # fmt: skip
                print(name, role, g, rows[f"{role}@{g}"], flush=True)
        out[name] = rows
    return out


def _licence() -> Path:
    return Path(str(importlib.metadata.distribution("transformers").locate_file("transformers-"
                f"{importlib.metadata.version('transformers')}.dist-info/licenses/LICENSE")))  # fmt: skip


def _group_models() -> dict[str, Path]:
    from swarm.errors import ModelError
    from swarm.model.packaged import gemma_gguf_path

    models = {"smollm2": default_model_dir()}
    try:
        models["gemma3-270m"] = gemma_gguf_path()
    except ModelError as e:
        print(f"gemma3-270m not measured: {e}", flush=True)
    return models


def _int4_bytes(lm: LocalModel) -> int:
    """What the int4 layers hold in bf16 serving (the fp32 copy here keeps fp32 scales: count bf16)."""
    from swarm.model.quant import QuantLinear

    total = 0
    for layer in lm.stages[0].layers:
        for m in layer.modules():
            if isinstance(m, QuantLinear):
                total += m.qweight.numel() * m.qweight.element_size() + m.scales.numel() * 2
            elif not list(m.children()):
                total += sum(p.numel() * 2 for p in m.parameters(recurse=False))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 1 perplexity window, 1 repeat")
    ap.add_argument("--only-load", action="store_true", help="re-measure gguf_load into the existing JSON")
    ap.add_argument("--only-moe", action="store_true", help="re-measure moe_layer into the existing JSON")
    ap.add_argument("--only-groups", action="store_true", help="re-measure int4_group_by_matrix into the existing JSON")
    a = ap.parse_args()
    if a.only_groups:
        torch.set_num_threads(a.threads)
        res = json.loads(RESULTS.read_text())
        res["int4_group_by_matrix"] = int4_group_by_matrix(_group_models(), _licence().read_text(encoding="utf-8"), 256)
        RESULTS.write_text(json.dumps(res, indent=2) + "\n")
        return
    if a.only_load or a.only_moe:
        res = json.loads(RESULTS.read_text())
        key = "gguf_load" if a.only_load else "moe_layer"
        res[key] = gguf_load(default_model_dir()) if a.only_load else moe_layer()
        print(json.dumps(res[key], indent=1))
        RESULTS.write_text(json.dumps(res, indent=2) + "\n")
        return
    torch.set_num_threads(a.threads)
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    res: dict[str, object] = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                              "torch": torch.__version__, "native_bf16": torch.backends.mkldnn.is_available()
                              and torch.ops.mkldnn._is_mkldnn_bf16_supported()}}  # fmt: skip
    bf = torch.bfloat16
    models = {q: _load(model_dir, bf, q) for q in ("none", "int8", "int4")}
    groups = {64: _load(model_dir, bf, "int4", 64), 32: models["int4"]}
    size = {q: block_nbytes(m.stages[0]) for q, m in models.items()}
    res["resident"] = {"bytes": size, "int8_over_bf16": size["int8"] / size["none"],
                       "int4_over_bf16": size["int4"] / size["none"],
                       "int4_over_bf16_by_group": {g: block_nbytes(m.stages[0]) / size["none"] for g, m in groups.items()},
                       "note": "an earlier run measured group 128: 0.278 of bf16 bytes, perplexity 26.49 (1.45x), as 64"}  # fmt: skip
    print(json.dumps(res["resident"], indent=1), flush=True)
    res["gguf_load"] = gguf_load(model_dir)
    print(json.dumps(res["gguf_load"], indent=1), flush=True)
    res["moe_layer"] = moe_layer()
    print(json.dumps(res["moe_layer"], indent=1), flush=True)

    # perplexity with fp32 activations: it isolates the weights' error, and dense bf16 matmuls of
    # 512-token windows take minutes on a CPU without native bf16
    f32 = {q: _load(model_dir, torch.float32, q) for q in ("none", "int8", "int4")}
    f32_groups = {64: _load(model_dir, torch.float32, "int4", 64), 32: f32["int4"]}
    lic = _licence()
    ids = tok.encode(lic.read_text(encoding="utf-8"))[: 513 if a.quick else 2049]
    ppl = {q: perplexity(m, ids) for q, m in f32.items()}
    print("perplexity", ppl, flush=True)
    ppl_g = {g: perplexity(m, ids) for g, m in f32_groups.items()}
    del f32_groups
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS[: 4 if a.quick else 16]]
    outs = {q: greedy(m, prompts, 16) for q, m in models.items()}
    agree = {q: [first_diff(outs["none"][i], outs[q][i]) for i in range(len(prompts))] for q in ("int8", "int4")}
    res["quality"] = {
        "text": f"{lic.relative_to(lic.parents[2])} ({len(ids)} tokens, windows of 512)",
        "perplexity_activations": "fp32 (weights quantized with fp32 scales); greedy agreement: bf16, the packed kernels",
        "perplexity": ppl, "int8_over_bf16": ppl["int8"] / ppl["none"], "int4_over_bf16": ppl["int4"] / ppl["none"],
        "int4_perplexity_by_group": ppl_g,
        "greedy_first_difference": {q: {"per_prompt": v, "identical": sum(x is None for x in v), "of": len(v),
                                        "new_tokens": 16, "median_first_difference": statistics.median([16 if x is None else x for x in v])}
                                    for q, v in agree.items()},  # fmt: skip
    }
    print(json.dumps(res["quality"], indent=1), flush=True)

    decode: dict[str, object] = {}
    for dname, dt in (("bf16", bf), ("fp32", torch.float32)):
        ms = models if dt == bf else f32
        new = a.new_tokens if dt == bf else 8  # fp32 int4 dequantizes every weight per token
        runs: dict[str, list[float]] = {q: [] for q in ms}
        for _ in range(1 if a.quick else a.repeats):
            for q in ("none", "int8", "int4", "int4", "int8", "none"):  # interleaved
                r = generate(ms[q], prompts[0][:16], max_new_tokens=new, eos_token_ids=())
                runs[q].append(r.decode_tokens_per_s)
        med = {q: statistics.median(v) for q, v in runs.items()}
        decode[dname] = {"tok_s": runs, "median_tok_s": med, "int8_over_none": med["int8"] / med["none"],
                         "int4_over_none": med["int4"] / med["none"]}  # fmt: skip
        print(dname, json.dumps(decode[dname]), flush=True)
    res["decode"] = decode
    res["int4_group_by_matrix"] = int4_group_by_matrix(_group_models(), lic.read_text(encoding="utf-8"), 256)
    res["plan_70b"] = plan_70b()
    print(json.dumps(res["plan_70b"], indent=1))
    res["gpu"] = "not measured: no GPU machine was lent to this session"
    res["command"] = "python benchmarks/bench_quant.py " + " ".join(sys.argv[1:])
    res["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
