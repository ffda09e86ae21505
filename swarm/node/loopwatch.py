"""How long the trio loop is held: the figure behind "liveness never waits on compute".

Two measurements, both cheap enough to run in every node:

- :class:`LoopWatch` is a trio Instrument timing every task step (the run of a task between two
  checkpoints: while it runs, nothing else on the loop does, heartbeats included). It keeps the
  longest step and the task that took it, overall and per second for the last BUCKETS seconds.
- its ticker task (``serve``) sleeps TICK_S at a time and records how late it wakes: the delay a
  heartbeat timer sees, including time the loop waited for the GIL while a compute thread ran.

A heartbeat is late by at most the lateness; a peer is declared lost after 2.5 s of silence
(failure.py), so both must stay far below that however busy the stage is. ``summary()`` goes into
the node's status (``loop``), where tests and benchmarks read it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import trio

TICK_S = 0.1  # at 0.01 s (100 wake-ups a second) it took ~3% of a LAN ring's token rate (bench_ring --only lan)
BUCKETS = 300  # seconds of per-second maxima kept


class LoopWatch(trio.abc.Instrument):
    def __init__(self) -> None:
        self._t0 = 0.0
        self.max_step_s = 0.0
        self.max_step_task = ""
        self.max_late_s = 0.0
        self.late_over_100ms = 0  # ticks that woke more than 100 ms late
        self.steps_over_100ms = 0  # task steps that held the loop more than 100 ms
        # (second, longest step, its task, largest lateness), one entry per second with activity
        self._buckets: deque[list[Any]] = deque(maxlen=BUCKETS)

    # -- Instrument hooks ------------------------------------------------------------------
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0 = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._t0 == 0.0:
            return  # the step that installed us started before we were there
        took = time.perf_counter() - self._t0
        if took > 0.001:
            if took > 0.1:
                self.steps_over_100ms += 1
            b = self._bucket()
            if took > b[1]:
                b[1], b[2] = took, task.name
            if took > self.max_step_s:
                self.max_step_s, self.max_step_task = took, task.name

    def _bucket(self) -> list[Any]:
        sec = int(time.monotonic())
        if not self._buckets or self._buckets[-1][0] != sec:
            self._buckets.append([sec, 0.0, "", 0.0])
        return self._buckets[-1]

    # -- the ticker ------------------------------------------------------------------------
    async def serve(self) -> None:
        """Run forever in a nursery; installs the instrument while it runs."""
        trio.lowlevel.add_instrument(self)
        try:
            while True:
                t = time.perf_counter()
                await trio.sleep(TICK_S)
                late = time.perf_counter() - t - TICK_S
                if late > 0.1:
                    self.late_over_100ms += 1
                self.max_late_s = max(self.max_late_s, late)
                b = self._bucket()
                b[3] = max(b[3], late)
        finally:
            trio.lowlevel.remove_instrument(self)

    def summary(self, window_s: int = 60) -> dict[str, Any]:
        """Longest step and lateness overall and over the last ``window_s`` seconds, in ms."""
        since = int(time.monotonic()) - window_s
        recent = [b for b in self._buckets if b[0] > since]
        step: list[Any] = max(recent, key=lambda b: b[1], default=[0, 0.0, "", 0.0])
        return {
            "max_step_ms": round(1000 * self.max_step_s, 2),
            "max_step_task": self.max_step_task,
            "max_late_ms": round(1000 * self.max_late_s, 2),
            "late_over_100ms": self.late_over_100ms,
            "steps_over_100ms": self.steps_over_100ms,
            "window_s": window_s,
            "window_max_step_ms": round(1000 * step[1], 2),
            "window_max_step_task": step[2],
            "window_max_late_ms": round(1000 * max((b[3] for b in recent), default=0.0), 2),
        }
