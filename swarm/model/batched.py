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
attention implementation, llama_layers.py). The pass itself is ``Stage.forward_batch``: the
stage's one layer loop (``Stage._walk``) with the sessions as one unit of rows
(``DecoderLayer.forward_rows``); this module decides when to take it.

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

import torch

from swarm.errors import ModelError
from swarm.model.llama_layers import DecoderLayer
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
    return stage.forward_batch(items)
