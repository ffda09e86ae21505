"""Several sessions through one stage in one call: ``forward_many(stage, [(session, h), ...])``.

The stage worker (swarm/node/stage_worker.py) hands every chunk that waits for it, from
different sessions, to one call. Each session keeps its own KV cache and positions; the result
for each is what ``stage.forward(session, h)`` alone gives (up to float rounding: see below).

This first implementation runs the sessions one after another inside the one call: one thread
hand-off for the whole batch instead of one per chunk, but no shared matrix products.

Exactness: each session's rows are computed alone, so fp32 and bf16 results equal
``Stage.forward`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from swarm.model.stage import Stage


def forward_many(stage: Stage, items: Sequence[tuple[Hashable, torch.Tensor]]) -> list[torch.Tensor]:
    """``[(session, h (T_i, D)), ...]`` with distinct sessions -> ``[(T_i, D), ...]`` in order;
    appends T_i entries to each session's cache, as ``stage.forward`` does."""
    sessions = [s for s, _ in items]
    if len(set(sessions)) != len(sessions):
        raise ValueError(f"forward_many: a session appears twice in one batch ({sessions})")
    return [stage.forward(session, h) for session, h in items]
