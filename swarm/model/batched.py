"""Several sessions through one stage in one call: ``forward_many(stage, [(session, h), ...])``.

The stage worker (swarm/node/ring/stage_worker.py) hands every chunk that waits for it, from
different sessions, to one call. Each session keeps its own KV cache and positions; the result
for each is what ``stage.forward(session, h)`` alone gives, up to float rounding (below).

Theory of operation
-------------------
Ragged batches without padding: the sessions' rows are concatenated, (1, N, D) with N the sum of
their lengths, for everything that works row by row (the norms, the Q/K/V and output
projections, the MLP): one matrix product per weight for the whole batch, which is where a
small batch is nearly free (a decode step reads every weight once whatever its row count).
Attention alone is per session: each session's rows get its own rotary positions, write its own
cache at its own position and attend over its own keys, through ``Attention.attend`` (the one
attention implementation, llama_layers.py).

Exactness: a row of a batched matrix product can differ in the last bits from the same row
computed alone (the kernel's blocking depends on the row count), so batched results are not
bit-identical to ``Stage.forward``. In fp32 that never changed a greedy token in the tests
(tests/model/test_batched.py, tests/node/); in bf16 a near-tie can flip, as between any two
machines. ``BATCHED`` False (or a stage whose layers are not the hand-written ones, e.g.
transformers' layers) runs the sessions one after another instead: one call and one thread
hand-off for the batch, rows computed alone, bit for bit ``Stage.forward``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import torch

from swarm.errors import ModelError
from swarm.model.llama_layers import Attention, DecoderLayer
from swarm.model.stage import Stage

BATCHED = True  # shared matrix products across sessions (False: one session after another)


def forward_many(stage: Stage, items: Sequence[tuple[Hashable, torch.Tensor]]) -> list[torch.Tensor]:
    """``[(session, h (T_i, D)), ...]`` with distinct sessions -> ``[(T_i, D), ...]`` in order;
    appends T_i entries to each session's cache, as ``stage.forward`` does."""
    sessions = [s for s, _ in items]
    if len(set(sessions)) != len(sessions):
        raise ModelError(f"forward_many: a session appears twice in one batch ({sessions})")
    handwritten = getattr(stage, "runtime", "handwritten") == "handwritten"
    if len(items) == 1 or not BATCHED or not handwritten or not all(type(x) is DecoderLayer for x in stage.layers):
        return [stage.forward(session, h) for session, h in items]
    return _forward_batched(stage, items)


@torch.inference_mode()
def _forward_batched(stage: Stage, items: Sequence[tuple[Hashable, torch.Tensor]]) -> list[torch.Tensor]:
    dim = stage.args.dim
    caches, lens, poss = [], [], []
    for session, h in items:
        if h.dim() != 2 or h.shape[1] != dim or h.shape[0] == 0:
            raise ModelError(
                f"stage [{stage.start}, {stage.end}) expects hidden states (T, {dim}) with T >= 1, got {tuple(h.shape)}"
            )
        cache = stage._cache(session)
        poss.append(cache.begin(h.shape[0]))  # this chunk's positions: update() writes them
        caches.append(cache)
        lens.append(h.shape[0])
    x = torch.cat([h.to(device=stage.device, dtype=stage.dtype) for _, h in items]).unsqueeze(0)  # (1, N, D)
    cos_all, sin_all = stage._rope_tables(max(p + t for p, t in zip(poss, lens, strict=True)))
    rope = [(cos_all[p : p + t], sin_all[p : p + t]) for p, t in zip(poss, lens, strict=True)]
    for module in stage.layers:
        layer = cast(DecoderLayer, module)  # forward_many checked the type
        attn = cast(Attention, layer.self_attn)
        hn = layer.input_layernorm(x)
        q, k, v = attn.q_proj(hn), attn.k_proj(hn), attn.v_proj(hn)  # (1, N, H*hd), (1, N, KV*hd) x2
        outs, off = [], 0
        for cache, t, pos, (cos, sin) in zip(caches, lens, poss, rope, strict=True):
            sl = slice(off, off + t)
            outs.append(attn.attend(q[:, sl], k[:, sl], v[:, sl], cos, sin, cache, layer.layer_idx, pos))
            off += t
        h = x + attn.o_proj(torch.cat(outs, dim=1))  # (1, N, D)
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    for cache, t in zip(caches, lens, strict=True):
        cache.advance(t)
    return list(torch.split(x[0], lens))  # [(T_i, D)]
