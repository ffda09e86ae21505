"""One-token steps of one session through a layer as one pass, where that is bit for bit exact.

Why: a replay after a re-plan (swarm/node/stage_worker.py, ``Stage.forward_seq``) must rebuild a
new stage's KV cache bit for bit as the lost stage held it, so it recomputes every fed chunk with
the shape it had: a decoded token is a one-token step. Through one layer such a step reads every
weight of the layer for one row, so replaying n decoded tokens costs n weight reads per layer,
which is what made the bundled model's resume slower than a re-prefill (faults_bundled.json).

Theory of operation
-------------------
R one-token steps at consecutive positions p, p+1, ... run through a hand-written decoder layer
(llama_layers.DecoderLayer) as one (1, R, D) pass for everything that works row by row (the norms,
the Q/K/V and output projections, the MLP: one weight read for R rows), and attention row by row,
each row exactly as the decode step computes it (``Attention.forward`` with T = 1), row p+i
writing its keys and values at p+i before row p+i+1 attends over them.

That is bit for bit the R steps one by one only if a matrix product's row does not depend on how
many rows it is computed with. A GEMM kernel may pick its blocking, and so its order of summation,
by the row count: on one machine measured here bf16 rows were identical up to 16 rows and differed
at 64, fp32 rows differed at every count. Nothing in torch promises either, and it varies by CPU
and library. So it is not assumed: :func:`rows_exact` runs the stage's own first layer (its real
weights, quantized ones included) on R random one-token steps both ways once per stage and row
count, and only a count whose outputs *and* cache entries compare equal to the last bit is used
(:data:`ROW_GROUPS`, largest first). Kernel choice depends on shapes, dtype and threads, not on
the values, and every layer of a hand-written stage has the same shapes. Where no count passes, a
replay computes its steps one by one, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from swarm.model.kvcache import KVCache
from swarm.model.llama_layers import DecoderLayer, apply_rope

ROW_GROUPS = (16, 8, 4, 2)  # row counts a replay may merge one-token steps into, each proven first


def layer_rows(
    layer: DecoderLayer,
    x: torch.Tensor,  # (1, R, D): R one-token steps of one session, in position order
    rope: Sequence[tuple[torch.Tensor, torch.Tensor]],  # each step's (cos, sin), (1, hd) each
    cache: Any,  # the session's KVCache: each row writes its keys/values at its position
    positions: Sequence[int],  # consecutive: p, p+1, ...
) -> torch.Tensor:
    """R one-token steps through ``layer`` in one pass (module doc) -> (1, R, D)."""
    attn = layer.self_attn
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    hn = layer.input_layernorm(x)
    q_all, k_all, v_all = attn.q_proj(hn), attn.k_proj(hn), attn.v_proj(hn)  # (1, R, H*hd), (1, R, KV*hd) x2
    outs = []
    for r, (pos, (cos, sin)) in enumerate(zip(positions, rope, strict=True)):
        # Attention.forward for T = 1, on row r's projections
        q = apply_rope(q_all[:, r : r + 1].reshape(1, 1, H, hd).transpose(1, 2), cos, sin)  # (1, H, 1, hd)
        k = apply_rope(k_all[:, r : r + 1].reshape(1, 1, KV, hd).transpose(1, 2), cos, sin)  # (1, KV, 1, hd)
        v = v_all[:, r : r + 1].reshape(1, 1, KV, hd).transpose(1, 2)
        cache._pos, cache._end = pos, pos + 1  # what begin() sets for this step
        keys, values = cache.update(k, v, layer.layer_idx)  # (1, KV, pos+1, hd)
        qp = q.reshape(1, KV, attn.n_rep, hd)
        out = F.scaled_dot_product_attention(qp, keys, values, scale=attn.scale).reshape(1, H, 1, hd)
        outs.append(out.transpose(1, 2).reshape(1, 1, H * hd))
    h = x + attn.o_proj(torch.cat(outs, dim=1))  # (1, R, D)
    return h + layer.mlp(layer.post_attention_layernorm(h))  # (1, R, D)


@torch.inference_mode()
def rows_exact(stage: Any, rows: int) -> bool:
    """Whether ``rows`` one-token steps through this stage's layers as one pass give exactly the
    bits of the steps one by one, on this machine (module doc); probed once per stage and count."""
    memo: dict[int, bool] = stage.rows_exact_memo
    if rows not in memo:
        memo[rows] = _probe(stage, rows)
    return memo[rows]


def _probe(stage: Any, rows: int) -> bool:
    layers = list(stage.layers)
    if getattr(stage, "runtime", "") != "handwritten" or not layers or any(type(x) is not DecoderLayer for x in layers):
        return False
    layer = layers[0]
    dim, dtype, device = stage.args.dim, stage.dtype, stage.device
    g = torch.Generator(device="cpu").manual_seed(1000 + rows)
    h = torch.randn(rows, dim, generator=g).to(device=device, dtype=dtype)  # (R, D)
    cos, sin = stage._rope_tables(rows)
    rope = [(cos[p : p + 1], sin[p : p + 1]) for p in range(rows)]
    one = KVCache(rows, dtype=dtype, device=device)
    steps = []
    for p in range(rows):
        one.begin(1)
        steps.append(layer(h[p : p + 1].unsqueeze(0), *rope[p], one, p))  # (1, 1, D)
        one.advance(1)
    many = KVCache(rows, dtype=dtype, device=device)
    together = layer_rows(layer, h.unsqueeze(0), rope, many, range(rows))
    many.advance(rows)
    idx = layer.layer_idx
    return (
        torch.equal(torch.cat(steps, dim=1), together)
        and torch.equal(one._k[idx], many._k[idx])
        and torch.equal(one._v[idx], many._v[idx])
    )


def row_units(stage: Any, chunks: Sequence[tuple[int, torch.Tensor]]) -> list[list[int]]:
    """Chunk indices in order, grouped: runs of one-token chunks at consecutive positions become
    groups of a proven row count (largest first); everything else stays on its own."""
    units: list[list[int]] = []
    run: list[int] = []

    def flush() -> None:
        i = 0
        while i < len(run):
            size = next((n for n in ROW_GROUPS if n <= len(run) - i and rows_exact(stage, n)), 1)
            units.append(run[i : i + size])
            i += size
        run.clear()

    for k, (pos, h) in enumerate(chunks):
        if h.shape[0] == 1 and run and pos == chunks[run[-1]][0] + 1:
            run.append(k)
            continue
        flush()
        if h.shape[0] == 1:
            run.append(k)
        else:
            units.append([k])
    flush()
    return units
