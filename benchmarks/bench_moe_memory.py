"""A gpt-oss-shaped MoE layer kept MXFP4: load peak ÷ resident bytes, and host syncs per layer.

    python benchmarks/bench_moe_memory.py [--experts 32] [--out benchmarks/results/moe_memory.json]

1. ``load``: one decoder layer with gpt-oss-120B's shapes (hidden 2880, experts of 2880 -> 2x2880
   -> 2880; ``--experts`` of its 128, to fit this host) and random weights, loaded as a stage with
   ``--quant mxfp4`` / ``int4`` / ``none``, each in a fresh process: the growth of its peak RSS
   (VmHWM) over its RSS before the load, ÷ the bytes the stage holds. On a CPU the host *is* the
   device, so this peak includes the float layer the host converts from (by design: conversions
   run on the host, layer by layer); on a GPU the device's own peak is gpu_check.py's
   ``load_peak_over_planned`` (the caching allocator's peak).
2. ``syncs``: host syncs of one MoE layer's experts forward, per token, for a decode step (1 token)
   and an 8-token verify chunk, counted op by op (torch's dispatch: unique, nonzero/where,
   bincount, item; plus ``tolist`` calls), *before* (the per-expert loop this module replaced,
   transformers' own, kept below verbatim) and *after* (model/quant_experts.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_shapes import RandomSource, published_config  # noqa: E402
from swarm.model.config import ModelArgs  # noqa: E402
from swarm.model.quant import QuantExperts  # noqa: E402

SYNCING = {"aten._unique2.default", "aten.unique_dim.default", "aten.nonzero.default",
           "aten._local_scalar_dense.default", "aten.bincount.default", "aten.masked_select.default"}


def layer_args(experts: int) -> ModelArgs:
    cfg = published_config("gpt-oss-120b")
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=1, layer_types=cfg["layer_types"][:1], num_local_experts=experts, vocab_size=512)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    return ModelArgs.from_config(cfg)


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_once(experts: int, quant: str) -> dict[str, Any]:
    """(in a fresh process) the peak growth of loading one layer ÷ what it holds."""
    from swarm.model.stage import Stage

    torch.set_num_threads(1)
    args = layer_args(experts)
    src = RandomSource(args, seed=0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss("VmRSS")
    stage = Stage.load(args, src, 0, 1, dtype=torch.bfloat16, quant=quant)
    peak = _rss("VmHWM") - before
    held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
    return {"held_mib": round(held / 2**20, 1), "peak_growth_mib": round(peak / 2**20, 1),
            "peak_over_resident": round(peak / held, 3)}


# ------------------------------------------------------------------------------ syncs
def old_forward(self: QuantExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """QuantExperts.forward before this change (commit fb2c6fe), as transformers' eager loop."""
    base = cast(Any, self.base)
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        if not 0 <= e < self.num_experts:
            continue
        token_idx, top_k_pos = torch.where(top_k_index == e)
        x = hidden_states[token_idx]
        h = base._apply_gate(self._project("gate_up_proj", e, x)) if base.has_gate else base.act_fn(self._project("up_proj", e, x))
        y = self._project("down_proj", e, h) * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.syncs += str(func) in SYNCING
        return func(*args, **(kwargs or {}))


def count_syncs(experts: QuantExperts, tokens: int, k: int, dim: int, old: bool, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).bfloat16()
    calls = [0]
    real = torch.Tensor.tolist

    def tolist(t: torch.Tensor) -> Any:
        calls[0] += 1
        return real(t)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with _Count() as c:
            (old_forward(experts, h, idx, w) if old else experts(h, idx, w))
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    return c.syncs + calls[0]


def syncs(experts_n: int) -> dict[str, Any]:
    from swarm.model.stage import Stage

    args = layer_args(experts_n)
    k = int(args.config["num_experts_per_tok"])
    stage = Stage.load(args, RandomSource(args, seed=1), 0, 1, dtype=torch.bfloat16, quant="mxfp4")
    ex = next(m for m in stage.modules() if isinstance(m, QuantExperts))
    out: dict[str, Any] = {}
    for tokens in (1, 8):
        row = {}
        for name, old in (("before", True), ("after", False)):
            counts = [count_syncs(ex, tokens, k, args.dim, old, seed) for seed in range(3)]
            row[name] = {"per_layer": statistics.median(counts), "per_token": round(statistics.median(counts) / tokens, 3)}
        out[f"{tokens}_tokens"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe_memory.json")
    ap.add_argument("--load-once", default=None, help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args(argv)
    if a.load_once:
        print(json.dumps(load_once(a.experts, a.load_once)))
        return 0
    result: dict[str, Any] = {
        "layer": f"gpt-oss-120B shapes (hidden 2880, expert 2880x5760 + 2880x2880), {a.experts} of 128 experts, bf16",
        "note": "CPU: the host is the device, so load peaks include the float layer converted on the host; "
                "a shared machine (other jobs running)",
        "load": {},
    }
    for quant in ("mxfp4", "int4", "none"):
        proc = subprocess.run([sys.executable, __file__, "--experts", str(a.experts), "--load-once", quant],
                              capture_output=True, text=True, timeout=900, check=True)
        result["load"][quant] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(quant, result["load"][quant], flush=True)
    result["syncs"] = syncs(a.experts)
    print(json.dumps(result["syncs"]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
