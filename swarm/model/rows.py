"""Several chunks of one session through a layer as one pass, where that is bit for bit exact.

Why: a replay after a re-plan (swarm/node/ring/stage_worker.py, ``Stage.forward_seq``) must rebuild a
new stage's KV cache bit for bit as the lost stage held it, so it recomputes every fed chunk with
the shape it had: a decoded token is a one-token step, a drafted round a verify chunk of a few
tokens. Through one layer each such chunk reads every weight of the layer for a few rows, so the
replay of a long generation cost a weight read per chunk per layer, which made the bundled
model's resume slower than a re-prefill (benchmarks/results/faults_bundled.json).

Theory of operation
-------------------
Consecutive small chunks of one session (each at most MAX_ROWS tokens, together at most MAX_ROWS)
run through a hand-written decoder layer as one (1, R, D) pass (``DecoderLayer.forward_rows``,
llama_layers.py, inside the stage's one layer loop ``Stage._walk``) for everything that works
row by row (the norms, the Q/K/V and output projections, the MLP: one weight read for R rows),
and attention chunk by chunk in order, each exactly as a forward of that chunk computes it
(``Attention.attend``, the one implementation of it): chunk j writes its keys and values at its
positions before chunk j+1 attends, so a chunk that starts inside the one before (a rejected
draft's tail) overwrites those entries just as it did the first time. This module says which
chunks may share a pass (:func:`row_units`).

That is bit for bit the chunks one by one only if a row of those row-wise operations does not
depend on how many rows it is computed with. A GEMM kernel may pick its blocking, and so its
order of summation, by the row count: on one machine measured here bf16 rows with one thread were
identical to single rows up to 16 rows and differed at 64, fp32 rows differed at every count, and
with two threads bf16 rows differed too. Nothing in torch promises either way, and it varies by
CPU, library and threads. So it is not assumed: :func:`rows_invariant` runs each row-wise module
of the stage's own first layer (its real weights, quantized ones included) on m random rows at
once and row by row, once per stage and row count, and a count is used only if every row of
every module compares equal to the last bit; a merged pass needs that of its own row count and
of each of its chunks' (each was computed at its own count first; all of them then give the
single-row bits). Kernel choice depends on shapes, dtype and threads, not on the values; every
layer of a hand-written stage has the same shapes, and a node sets its threads once. Where a count
is not proven, the replay computes those chunks one by one, layer by layer, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from swarm.model.llama_layers import DecoderLayer

log = logging.getLogger("swarm.model.rows")

MAX_ROWS = 16  # the most rows one merged pass takes (and the largest chunk it merges)


def rows_invariant(stage: Any, rows: int) -> bool:
    """Whether ``rows`` rows through this stage's row-wise modules give each row's single-row
    bits, on this machine (module doc); every count is probed at once, the first time."""
    if rows <= 1:
        return True
    memo: dict[int, bool] = stage.rows_exact_memo
    if not memo:
        memo.update(prove(stage))
    return memo.get(rows, False)


def prove(stage: Any) -> dict[int, bool]:
    """Row count (2..MAX_ROWS) -> whether it is proven (module doc), for this stage's layer
    signature (its modules' types, shapes and dtypes, the device and the thread count): proven
    once per process and signature, so a node proves it when it measures its speed at start-up
    (node/compute/runtime.py) and every block it loads later of that model reuses the verdict."""
    layers = list(stage.layers)
    if getattr(stage, "runtime", "") != "handwritten" or not layers or any(type(x) is not DecoderLayer for x in layers):
        return dict.fromkeys(range(2, MAX_ROWS + 1), False)
    key = signature(layers[0], stage.dtype, stage.device)
    if key not in _PROVEN:
        _PROVEN[key] = _prove(stage, layers[0])
    return dict(_PROVEN[key])


def signature(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
    """What a kernel's choice can depend on: every module's type and its tensors' shapes and
    dtypes, the dtype, device and intra-op thread count (not the values)."""
    mods = tuple(
        (name, type(m).__name__, tuple((n, tuple(t.shape), str(t.dtype)) for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]))
        for name, m in layer.named_modules()
    )
    return (str(dtype), str(device), torch.get_num_threads(), mods)


_PROVEN: dict[tuple[Any, ...], dict[int, bool]] = {}  # signature -> row count -> proven


@torch.inference_mode()
def _prove(stage: Any, layer: DecoderLayer) -> dict[int, bool]:
    counts = range(2, MAX_ROWS + 1)
    attn = layer.self_attn
    proven = dict.fromkeys(counts, True)
    g = torch.Generator(device="cpu").manual_seed(1000)
    for module, width in (
        (layer.input_layernorm, stage.args.dim),
        (attn.q_proj, stage.args.dim),
        (attn.k_proj, stage.args.dim),
        (attn.v_proj, stage.args.dim),
        (attn.o_proj, attn.n_heads * attn.head_dim),
        (layer.post_attention_layernorm, stage.args.dim),
        (layer.mlp, stage.args.dim),
    ):
        x = torch.randn(1, MAX_ROWS, width, generator=g).to(device=stage.device, dtype=stage.dtype)  # (1, M, W)
        alone = [module(x[:, i : i + 1]) for i in range(MAX_ROWS)]  # each (1, 1, out)
        for m in counts:
            if proven[m] and not torch.equal(module(x[:, :m]), torch.cat(alone[:m], dim=1)):
                proven[m] = False
    missing = [m for m in counts if not proven[m]]
    if missing:
        log.info(
            "stage [%d, %d) %s: rows at once are not bit for bit rows alone here for %s rows: a replay "
            "computes such chunks one by one", stage.start, stage.end, stage.dtype, ", ".join(map(str, missing)),
        )
    return proven


def row_units(stage: Any, chunks: Sequence[tuple[int, torch.Tensor]]) -> list[list[int]]:
    """Chunk indices in order, grouped into merged passes (module doc): consecutive chunks of at
    most MAX_ROWS rows together, each chunk's row count and the pass's proven; others alone."""
    units: list[list[int]] = []
    cur: list[int] = []
    rows = 0
    for k, (_, h) in enumerate(chunks):
        t = h.shape[0]
        mergeable = t <= MAX_ROWS and rows_invariant(stage, t)
        if mergeable and cur and rows + t <= MAX_ROWS and rows_invariant(stage, rows + t):
            cur.append(k)
            rows += t
            continue
        if cur:
            units.append(cur)
        cur, rows = ([k], t) if mergeable else ([], 0)
        if not mergeable:
            units.append([k])
    if cur:
        units.append(cur)
    return units
