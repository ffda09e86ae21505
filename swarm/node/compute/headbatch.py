"""The coordinator's LM head, shared by the sessions whose results arrive together.

Theory of operation
-------------------
A session that needs logits queues its rows; whoever finds the head idle runs every queued
request as one call (rows concatenated) and hands each session its rows, until the queue is
empty, so sessions whose results arrive together share one pass over the head's weights (the
biggest matrix a small model has). Batched rows can differ from rows computed alone in the last
bits (a GEMM's blocking depends on its row count): in fp32 greedy tokens stay the same in
practice (the tests check), in bf16 a near-tie can flip; the receipt counts
``shared_head_calls``.

Gathering. A cohort's results leave the tail one after another; a head run for the first ones
alone sends the rest round the ring a head call later, and the split goes on round the ring
(stage_worker.py: gathering). So an idle head first lets the sessions woken by the same burst
queue (a few scheduler passes), then waits, up to one typical head call, for the sessions whose
results are due about now (one cycle after their last) and those that shared the queued ones'
last head call, while they are still generating. When every session generating has queued
already (one generation alone), there is no one to wait for: the head starts at once (on a lone
token's path, those scheduler passes cost ~0.1 ms a token on a shared box).

The head runs in a worker thread behind the process's compute limiter, except a call predicted
to take under INLINE_MAX_S, or one session's small rows alone in the call whose typical call
takes under LONE_INLINE_MAX_S (swarm/model/batched.py, as in stage_worker.py; the loop checkpoints after it,
or, after one session's call, its task does at its next await: it samples, sends the next chunk
and awaits its result, so that chunk leaves before anything else runs), so the trio loop
answering heartbeats is never held long by compute. The lone case is one
generation's decode step: a dense head of a small model (7 ms for SmolLM2-135M's 49152 x 576)
is over INLINE_MAX_S, and its hand-off to a thread and back was on every token's path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import trio

from swarm.model.batched import SMALL_TOKENS, InlinePolicy
from swarm.model.stage import Head
from swarm.node.compute.runtime import Compute

MAX_HEAD_BATCH = 32  # sessions' rows in one LM head call
HEAD_GATHER_PASSES = 4  # scheduler passes an idle head waits for more sessions' rows (while they come)
HEAD_GATHER_MAX_S = 0.05  # the longest an idle head waits for sessions due (module doc)


@dataclass(eq=False)
class _HeadRequest:
    rows: torch.Tensor  # (T, D)
    session: int = 0
    out: torch.Tensor | None = None  # (T, V) once computed
    shared: bool = False
    error: BaseException | None = None
    wake: trio.Event = field(default_factory=trio.Event)


class SharedHead:
    """``await logits(rows, session)``: the head's logits, computed with other sessions' rows."""

    def __init__(
        self,
        head: Head,
        compute: Compute,
        *,
        live: Callable[[], Collection[int]],
        compute_delay_s: float = 0.0,
    ) -> None:
        self.head = head
        self.compute = compute  # where a call that is not predicted quick runs (runtime.py)
        self.live = live  # the sessions still generating
        self.compute_delay_s = compute_delay_s  # fault injection for load tests (see stage_worker)
        self.placing = InlinePolicy()  # where a call runs: the trio thread or a worker (model/batched.py)
        self._typical_s = math.inf  # ... and its running mean: the gathering window
        self._queue: list[_HeadRequest] = []
        self._busy = False
        self._queued = trio.Event()  # set when a request joins the queue
        self._mates: dict[int, frozenset[int]] = {}  # session -> the sessions of its last head call
        self._result_at: dict[int, float] = {}  # session -> trio time of its last result
        self._cycle: dict[int, float] = {}  # session -> the time between its last two results

    def note_result(self, session: int) -> None:
        """A result for ``session`` came in from the tail (its cycle: when the next is due)."""
        now = trio.current_time()
        last = self._result_at.get(session)
        if last is not None:
            self._cycle[session] = now - last
        self._result_at[session] = now

    def forget(self, session: int) -> None:
        for state in (self._mates, self._result_at, self._cycle):
            state.pop(session, None)

    def held(self) -> dict[str, int]:
        """Requests queued, and the sessions whose figures are kept (status ``held``)."""
        return {"head_queued": len(self._queue), "head_tracked": len(self._mates.keys() | self._result_at.keys())}

    async def logits(self, rows: torch.Tensor, session: int = 0) -> tuple[torch.Tensor, bool]:
        """Logits of ``rows`` (T, D), computed with whatever other sessions queued meanwhile;
        also whether the call was shared."""
        req = _HeadRequest(rows, session)
        self._queue.append(req)
        self._queued.set()
        while req.out is None:
            if req.error is not None:
                raise req.error
            if not self._busy:
                await self._run_queue()
            else:
                req.wake = trio.Event()
                await req.wake.wait()
        return req.out, req.shared

    async def _run_queue(self) -> None:
        self._busy = True
        try:
            if not set(self.live()) <= {r.session for r in self._queue}:  # (all queued: a lone run's head starts at once)
                for _ in range(HEAD_GATHER_PASSES):  # sessions woken by the same burst of results queue too
                    n = len(self._queue)
                    await trio.lowlevel.checkpoint()
                    if len(self._queue) == n:
                        break
                await self._gather()
            while self._queue:
                batch, self._queue = self._queue[:MAX_HEAD_BATCH], self._queue[MAX_HEAD_BATCH:]
                try:
                    out = await self._call(torch.cat([r.rows for r in batch]) if len(batch) > 1 else batch[0].rows,
                                          lone=len(batch) == 1)
                except Exception as exc:
                    for r in batch:
                        r.error = exc
                        r.wake.set()
                    continue
                except BaseException:  # cancelled (our own session ended): another waiter runs them
                    self._queue[:0] = batch
                    raise
                mates, live = frozenset(r.session for r in batch), self.live()
                i = 0
                for r in batch:
                    if r.session in live:  # one that ended while its request ran was forgotten: not again
                        self._mates[r.session] = mates
                    n = r.rows.shape[0]
                    r.out, r.shared = out[i : i + n], len(batch) > 1
                    i += n
                    r.wake.set()
        finally:
            self._busy = False
            for r in self._queue:
                r.wake.set()  # each waiter looks again: one of them runs the rest

    async def _gather(self) -> None:
        """Wait (bounded) for the sessions whose results are due about now (module doc)."""
        window = min(self._typical_s, HEAD_GATHER_MAX_S)
        if not self.compute.threads or window == math.inf:  # inline compute: in-memory tests, mock clock
            return
        with trio.move_on_after(window):
            while True:
                queued = {r.session for r in self._queue}
                now = trio.current_time()
                due = {m for s in queued for m in self._mates.get(s, ())}
                due.update(s for s, c in self._cycle.items() if abs(self._result_at[s] + c - now) <= window)
                due = (due - queued) & set(self.live())
                if not due or len(queued) >= MAX_HEAD_BATCH:
                    return
                self._queued = trio.Event()
                await self._queued.wait()

    def _compute(self, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        if self.compute_delay_s > 0:
            time.sleep(self.compute_delay_s)  # fault injection: compute that blocks
        out = self.head.logits(rows).cpu()  # on a GPU: wait here (timed, off the loop); CPU: no copy
        return out, time.perf_counter() - t0

    async def _call(self, rows: torch.Tensor, *, lone: bool) -> torch.Tensor:
        """LM head on the trio thread when it is predicted quick (or one session's small rows
        alone, ``lone``, typically quick: model/batched.py), else in a worker thread."""
        small = rows.shape[0] <= SMALL_TOKENS
        if not self.compute.threads or (small and self.placing.inline(small=small, lone=lone)):
            out, took = self._compute(rows)
            if not lone:  # one session's: its task's next await yields (it samples, sends, awaits a result)
                await trio.lowlevel.checkpoint()
        else:
            out, took = await self.compute.run(self._compute, rows)
        self.placing.note(took, small=small)
        if small:
            t = self._typical_s
            self._typical_s = took if t == math.inf else 0.8 * t + 0.2 * took
        return out
