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

Where a call runs (:class:`InlinePolicy`): on the caller's event-loop thread, or in a worker
thread behind the node's compute limiter. The node's stage worker (swarm/node/ring/stage_worker.py)
and the coordinator's LM head (swarm/node/compute/headbatch.py) each hold one; it lives here, beside
the call it places, and is pure (no trio: the callers do the hand-off; they also take the
measured figures below from the node). A thread hand-off costs two wake-ups (the worker's, then the trio thread's to take the result
back): ~0.2 ms on an idle box, several ms on a loaded one (the LAN ring bench at load 6: a
stage's "forward -> sent" took 3.2-3.5 ms when its forwards went to a thread, ~0.4 ms inline).
The trio loop answers heartbeats, so it may be held by compute only briefly. Hence two rules:

- any call predicted to take under INLINE_MAX_S runs inline. The prediction rises at once with
  any slower call and decays slowly, so a batch that grew (more sessions, a longer context) is
  never run inline on an old, smaller figure;
- one session's small call alone (a decode step or a small verify chunk: the ring's
  latency-bound case, where the hand-off is on every token's path) runs inline when its
  *typical* time is under LONE_INLINE_MAX_S. Typical is the median of the last LONE_SAMPLES
  small calls, not the rise-at-once prediction: on a busy box a call that was preempted half-way
  takes several times its compute (5-10% of a stage's decode forwards took over 50 ms at load 6,
  median 17-24 ms), and under the rise-at-once rule each such call sent the next several
  forwards to a thread (only 24-43% ran inline), paying the hand-off exactly when it costs most.
  A preempted call says nothing about the next one's compute; a slower model or a longer
  context moves the median within a few calls.

A loop held LONE_INLINE_MAX_S (50 ms) is 2% of the failure detector's patience (2.5 s); the
caller checkpoints after every inline call (``swarm.node.loopwatch`` measures the longest hold).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
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


INLINE_MAX_S = 0.005  # a call predicted to compute in less runs on the trio thread
LONE_INLINE_MAX_S = 0.05  # ... and one session's small call whose typical time is less (module doc)
LONE_SAMPLES = 5  # small calls the typical time is the median of
SMALL_TOKENS = 16  # a call of at most this many rows is small (decode steps, verify chunks)


class InlinePolicy:
    """``inline(...)`` before a call says where it runs; ``note(...)`` after it says what it took."""

    def __init__(self) -> None:
        self.predict_s = math.inf  # any small call's time: rises at once, decays slowly
        self._recent: deque[float] = deque(maxlen=LONE_SAMPLES)  # the last small calls' times

    @property
    def typical_s(self) -> float:
        """The median of the last small calls' times (inf before the first)."""
        return statistics.median(self._recent) if self._recent else math.inf

    def inline(self, *, calls: int = 1, small: bool, lone: bool) -> bool:
        """Whether ``calls`` forwards in a row (a replay group), ``small`` ones, for one session
        alone (``lone``) or several, run on the trio thread."""
        if self.predict_s * calls < INLINE_MAX_S:
            return True
        return lone and small and calls == 1 and self.typical_s < LONE_INLINE_MAX_S

    def note(self, took: float, *, calls: int = 1, small: bool) -> None:
        """A call (``calls`` forwards, ``small`` or not) took ``took`` seconds."""
        # the prediction is per forward of a small batch; a big one says nothing about small ones
        if small or (calls == 1 and took > self.predict_s):
            p = self.predict_s
            self.predict_s = took if (p == math.inf or took > p) else 0.9 * p + 0.1 * took
        if small and calls == 1:
            self._recent.append(took)
