"""Capacity: how many sessions a ring holds at once, and the queue in front of it.

Theory of operation
-------------------
Each stage preallocates a session's KV cache at the context length (kvcache.py), so what a stage
can hold is explicit: the sessions whose KV fits beside the rest of its predicted peak (its
block's weights, one prefill chunk's activations, the head if it is also the coordinator) in the
memory its peer advertised, which is already what it offered less its own overhead
(planner/budget.py: the planner, this and ``plan``/``status`` share that arithmetic). The planner
reserves each peer's own ``NodeSettings.sessions`` sessions' KV per layer (its advert's ``sessions``;
default MIN_SESSIONS; an advert without it: the leader's), so every planned stage holds at least
its peer's count, all inside ``--memory``. The ring holds the least of its stages and of its
coordinator, which holds each session's results and logits even when it holds no layers (capped at
MAX_SESSIONS, the stage worker's own bound): a member that reserves 2 makes it at least 2.

The coordinator admits that many generations at once (:class:`SlotQueue`); the next ones wait in
a FIFO queue, each told its place in a one-line notice, up to MAX_QUEUED; past that a request is
refused at once with :class:`Busy` (the API answers 429 with ``Retry-After``), never by running a
stage out of memory. A slot is held from a generation's start to its end, across re-plans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import trio

from swarm.errors import Busy
from swarm.planner import ModelSpec, Plan
from swarm.planner.budget import sessions_that_fit

MAX_SESSIONS = 64  # a stage never holds more (stage_worker.StageWorker.max_sessions)
MIN_SESSIONS = 8  # ... and the planner reserves this many in every stage (NodeSettings.sessions)
MAX_QUEUED = 32  # generations waiting for a slot at one coordinator
RETRY_AFTER_S = 5


def stage_capacity(spec: ModelSpec, memory_bytes: int, block: tuple[int, int], *, coordinator: bool,
                   draft_bytes: int = 0) -> int:
    """Sessions a peer advertising ``memory_bytes`` holds with layers ``block`` at the spec's
    context (and, coordinating, a draft model of ``draft_bytes``), at least one: a planned stage
    holds the spec's reserve."""
    fits = sessions_that_fit(spec, memory_bytes, block, coordinator=coordinator, draft_bytes=draft_bytes)
    return MAX_SESSIONS if fits is None else max(1, min(MAX_SESSIONS, fits))


def ring_capacity(spec: ModelSpec, plan: Plan, memory: Mapping[str, int], drafts: Mapping[str, int] | None = None,
                  widths: Mapping[str, int] | None = None) -> int:
    """Sessions the whole ring holds at once: the least of its stages (unknown memory: one);
    ``drafts``: the draft model bytes each peer advertises (the planner counts the coordinator's);
    ``widths``: the width each serves in, where its advert gives one (ModelSpec.at_width, as the
    planner states its layers)."""
    drafts, widths = drafts or {}, widths or {}
    blocks = {plan.coordinator: (0, 0)} | plan.blocks  # a head-only coordinator too: its sessions' results and logits
    caps = [
        stage_capacity(spec.at_width(widths[p]) if p in widths else spec, memory[p], block,
                       coordinator=p == plan.coordinator, draft_bytes=drafts.get(p, 0))
        if memory.get(p) else 1
        for p, block in blocks.items()
    ]  # fmt: skip
    return min(caps, default=1)


class SlotQueue:
    """At most ``capacity`` generations at once, a FIFO queue of ``max_queued`` behind them."""

    def __init__(self, capacity: int = 1, *, max_queued: int = MAX_QUEUED) -> None:
        self.capacity = max(1, capacity)
        self.max_queued = max_queued
        self.active = 0
        self._queue: deque[trio.Event] = deque()

    @property
    def queued(self) -> int:
        """Generations waiting for a slot."""
        return len(self._queue)

    def set_capacity(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._wake()

    def _wake(self) -> None:
        for ev in list(self._queue)[: max(0, self.capacity - self.active)]:
            ev.set()

    async def enter(self, notify: Callable[[str], None] = lambda text: None) -> None:
        """Take a slot, waiting in the queue if every slot is taken; Busy when the queue is full."""
        if self.active < self.capacity and not self._queue:
            self.active += 1
            return
        if len(self._queue) >= self.max_queued:
            raise Busy(
                f"the swarm is busy: {self.active} generations run (the ring's KV memory holds {self.capacity} "
                f"at a time) and {len(self._queue)} wait; retry in {RETRY_AFTER_S} s",
                RETRY_AFTER_S,
            )
        ev = trio.Event()
        self._queue.append(ev)
        notify(
            f"queued: the ring holds {self.capacity} generations at a time (its KV memory at the context "
            f"length) and {self.active} run; {len(self._queue) - 1} wait ahead of this one"
        )
        try:
            while not (ev.is_set() and self.active < self.capacity):
                ev = self._requeue(ev)
                await ev.wait()
        except BaseException:
            if ev in self._queue:
                self._queue.remove(ev)
            self._wake()
            raise
        self._queue.remove(ev)
        self.active += 1

    def _requeue(self, ev: trio.Event) -> trio.Event:
        """A woken waiter that found no slot waits again, keeping its place."""
        if not ev.is_set():
            return ev
        fresh = trio.Event()
        self._queue[self._queue.index(ev)] = fresh
        return fresh

    def leave(self) -> None:
        self.active = max(0, self.active - 1)
        self._wake()
