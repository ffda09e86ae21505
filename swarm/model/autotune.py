"""Choosing a CPU stage's dtype, threads and quantized kernels by measurement, not by name.

Why: the names lie on CPUs. Without native bf16 a bf16 decode step was still ~2x faster than
fp32 on the AVX2 EPYC of issue 30 (less memory to read); with native bf16 (this project's
AVX512-BF16 EPYC) a dense bf16 layer measured slower than fp32 under load; an int4 layer with fp32
activations dequantized its weight on every call, 46x slower than the dense fp32 layer it
replaced (31.5 ms against 0.68 ms for a 1536x576 weight, one token), while torch's packed int4
kernel with the activation rounded to bf16 took 0.42 ms; and a second thread made a loaded 2-core
box slower, not faster (1.0 against 2.3 tok/s, fp32, bundled model).

Theory of operation
-------------------
:func:`measure` times one decode step (one token) of one decoder layer with random weights of
the model's own shapes, for every candidate the CPU allows (:func:`candidates`): serving dtype
fp32 or bf16, and for a quantized stage the kernel's activation dtype (``kernel`` "same": the
serving dtype, so fp32 takes the dequantize-per-call path; "bf16": torch's packed int8/int4
kernels, the activation rounded to bf16 at the kernel's input and the result back in the serving
dtype). Candidates are measured alternated, round after round, at every thread count, and each
figure is a median, so a burst of load elsewhere hits all of them alike.

:func:`choose` is pure (measurements in, choice out) and unit-tested: the fastest candidate, but
among those within ``margin`` of it the first in a fixed order of preference (fp32 before bf16,
the serving dtype's kernel before a cast, fewer threads before more): a close race goes to what
is exact across CPUs (fp32) and to what leaves cores to the rest of the machine. So threads never
slow a stage down: a thread count is taken only when it measured faster.

The choice is cached per machine (``cache_dir()/autotune.json``), keyed by the CPU's model and
flags, torch's version, the layer signature (shapes, quantization) and the cores: a stage
measures once per machine and model shape (a few seconds), and every later start of the same
machine makes the same choice, so a replay on it uses the same kernels (the exactness contract:
bit for bit needs the same dtype, kernels and threads; a receipt records dtype and threads).
Another machine measures for itself and may choose otherwise: across machines only fp32 with the
serving dtype's kernels is promised to give the same tokens, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.model.config import ModelArgs

log = logging.getLogger("swarm.model.autotune")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MARGIN = 0.05  # a candidate must be >5% faster than a preferred one to win (measurement noise)
PRUNE = 2.0  # after one round, a candidate this many times slower than the fastest is not timed again
CACHE_VERSION = 1


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to run a stage on this CPU: serving ``dtype``, the quantized kernels' activation
    dtype (``kernel`` "same" or "bf16"; "same" for an unquantized stage) and ``threads``."""

    dtype: str
    kernel: str
    threads: int

    @property
    def key(self) -> str:
        return f"{self.dtype}/{self.kernel}/{self.threads}"

    @classmethod
    def from_key(cls, key: str) -> Candidate:
        dtype, kernel, threads = key.split("/")
        return cls(dtype, kernel, int(threads))

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kernel_dtype(self) -> torch.dtype | None:
        """The dtype quantized linears are packed in (None: the serving dtype)."""
        return DTYPES[self.kernel] if self.kernel != "same" else None


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked, with the figures it picked from (ms per layer per token)."""

    best: Candidate
    ms: dict[str, float]
    quant: str


def candidates(
    quant: str, threads: Sequence[int], dtypes: Sequence[str] = ("fp32", "bf16"), casts: bool = True
) -> list[Candidate]:
    """Every candidate in order of preference: fp32 first, the serving dtype's kernel before a cast
    to bf16, fewer threads first. bf16 is allowed on every CPU (emulated where not native: slower,
    never wrong); ``dtypes`` narrows it (an explicit ``--dtype``), ``threads`` likewise; ``casts``
    False keeps quantized linears in the serving dtype (the numbers a ring's stages compute)."""
    out: list[Candidate] = []
    for dt in dtypes:
        kernels = ["same"] if quant == "none" or dt == "bf16" or not casts else ["same", "bf16"]
        for k in kernels:
            out.extend(Candidate(dt, k, t) for t in sorted(set(threads)))
    return out


def choose(ms: Mapping[Candidate, float], order: Sequence[Candidate], margin: float = MARGIN) -> Candidate:
    """The first candidate of ``order`` within ``margin`` of the fastest measured one (pure).

    ``ms``: median milliseconds per decode step of each measured candidate (others are ignored).
    """
    measured = [c for c in order if c in ms]
    if not measured:
        raise ValueError("choose: no candidate was measured")
    fastest = min(ms[c] for c in measured)
    return next(c for c in measured if ms[c] <= fastest * (1.0 + margin))


# ------------------------------------------------------------------------------ measuring
def _probe_stage(args: ModelArgs, cand: Candidate, quant: str) -> Any:
    from swarm.model.quant import quantize_block
    from swarm.model.stage import Stage

    dtype = cand.torch_dtype()
    stage = Stage(args, 0, 1, dtype=dtype, device="cpu").to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    stage.requires_grad_(False)
    quantize_block(stage, quant, dtype=dtype, kernel_dtype=cand.kernel_dtype())
    return stage


@torch.inference_mode()
def measure(
    args: ModelArgs, cands: Sequence[Candidate], quant: str, *, rounds: int = 5, steps: int = 8,
    budget_s: float = 0.1, prune: float = PRUNE,
) -> dict[Candidate, float]:
    """Median ms of one decode step of one layer for each candidate, alternated round by round.

    A sample is ``steps`` steps or as many as ``budget_s`` allows (at least one); after the first
    round a candidate over ``prune`` times the fastest is dropped (its first figure is kept): a
    dequantize-per-call layer at 30x the packed one need not be timed five times to lose."""
    stages: dict[tuple[str, str], Any] = {}
    for c in cands:
        if (c.dtype, c.kernel) not in stages:
            stage = _probe_stage(args, c, quant)
            stage.open_session("probe", steps + 2)
            stages[(c.dtype, c.kernel)] = stage
    before = torch.get_num_threads()
    times: dict[Candidate, list[float]] = {c: [] for c in cands}
    live = list(cands)
    try:
        for r in range(rounds):
            for c in live:
                stage = stages[(c.dtype, c.kernel)]
                torch.set_num_threads(c.threads)
                h = torch.randn(1, args.dim).to(c.torch_dtype())
                stage.forward("probe", h)  # warm-up at this thread count (not timed)
                n, t0 = 0, time.perf_counter()
                while n < steps and (n == 0 or time.perf_counter() - t0 < budget_s):
                    stage.forward("probe", h)
                    n += 1
                times[c].append((time.perf_counter() - t0) * 1000.0 / n)
                stage.rollback("probe", 0)
            if r == 0:
                fastest = min(times[c][0] for c in live)
                live = [c for c in live if times[c][0] <= prune * fastest]
    finally:
        torch.set_num_threads(before)
    return {c: statistics.median(v) for c, v in times.items()}


# ------------------------------------------------------------------------------ the cache
def machine_key() -> dict[str, Any]:
    """What a CPU kernel's speed depends on besides the layer: CPU model and flags, torch, cores."""
    from swarm.model.devices import cpu_name

    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu_name(),
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "cores": os.cpu_count() or 1,
    }


def layer_signature(args: ModelArgs, quant: str) -> str:
    shapes = args.quantizable_shapes()[0] if args.n_layers else []
    return f"{args.architecture}:{args.dim}:{args.n_heads}/{args.n_kv_heads}x{args.head_dim}:{shapes}:{quant}"


def cache_path() -> Path:
    from swarm.model.bundled import cache_dir

    return cache_dir() / "autotune.json"


def _entry_key(args: ModelArgs, quant: str, dtypes: Sequence[str], threads: Sequence[int]) -> str:
    raw = json.dumps([CACHE_VERSION, machine_key(), layer_signature(args, quant), list(dtypes), list(threads)], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tune(
    args: ModelArgs,
    quant: str = "none",
    *,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    threads: Sequence[int] | None = None,
    casts: bool = True,
    path: Path | None = None,
    refresh: bool = False,
) -> Choice:
    """The cached choice for this machine and layer shape, else measure, choose and cache it.

    ``dtypes``: the serving dtypes allowed (``--dtype auto``: both; an explicit one: itself, so
    only threads and kernels are tuned); ``threads``: the counts allowed (default 1..cores);
    ``casts``: see :func:`candidates`. A cache that cannot be written is only logged."""
    counts = sorted(set(threads or range(1, (os.cpu_count() or 1) + 1)))
    path = path or cache_path()
    key = _entry_key(args, quant, [*dtypes, "casts" if casts else "nocasts"], counts)
    cache = _read_cache(path)
    hit = cache.get(key)
    if not refresh and isinstance(hit, dict) and "best" in hit:
        with contextlib.suppress(KeyError, ValueError, TypeError):
            return Choice(Candidate.from_key(hit["best"]), {k: float(v) for k, v in hit["ms"].items()}, quant)
    order = candidates(quant, counts, dtypes, casts)
    ms = measure(args, order, quant)
    best = choose(ms, order)
    choice = Choice(best, {c.key: round(v, 4) for c, v in ms.items()}, quant)
    log.info("autotune %s quant=%s: %s (ms per layer-step: %s)", layer_signature(args, quant), quant, best.key, choice.ms)
    cache[key] = {"best": best.key, "ms": choice.ms, "machine": machine_key(),
                  "signature": layer_signature(args, quant), "measured_at": time.time()}  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # atomic: several processes of one machine may tune at once
    except OSError as e:
        log.warning("autotune: cannot write %s (%s); the choice is not cached", path, e)
    return choice
