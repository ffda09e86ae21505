"""Where a forward runs: on the trio thread, or in a worker thread behind the compute limiter.

Theory of operation
-------------------
A thread hand-off costs two wake-ups (the worker's, then the trio thread's to take the result
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
The stage worker (ring/stage_worker.py) and the coordinator's LM head (headbatch.py) each hold
one :class:`InlinePolicy`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

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
