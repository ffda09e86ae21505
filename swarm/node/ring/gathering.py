"""Gathering: which sessions a stage's next forward waits for, so that they share it.

Theory of operation
-------------------
Sessions' chunks reach a stage one frame at a time
(the coordinator sends them one after another), so a loop that computes whatever is queued the
moment the first frame lands runs a batch of one, then the rest: the split goes round the ring,
and each stage reads its weights once per fragment (measured: mostly batches of one). So before a
forward the worker waits for sessions on their way:

- *due*: up to one small forward's typical time (a running mean), for the sessions that shared
  the queued ones' last forward (a forward's sessions come back together; not for a chunk that
  arrived before that forward ended: a second chunk in flight). Waiting W costs the queued ones
  W; running a straggler separately costs the stage one more forward, about W. (Predicting each
  session's arrival from its last inter-arrival time as well was measured: it waited more, in
  vain half the time, and gave less);
- *merge*: otherwise, if the queued group is the smaller part of the active sessions (a tie: the
  group without the lowest session id), it waits for the others until the last of them is
  expected (at most GATHER_MERGE_MAX_S), so split groups merge once and then stay merged (not
  for a second chunk in flight: drafting keeps several of a session's chunks on the ring);

and each wait ends as soon as every session waited for is queued. A lone session never waits;
one just joining (no cycle yet) or quiet for two of its cycles is never waited for to merge. The wait is an
await on the queue with a deadline: liveness is not touched, and a long prompt still takes one
piece per forward.

Replay chunks (a run resumed after a re-plan, coordinator.py) are never waited for: a session's
queued ones are computed at once (stage_worker.py).

A :class:`Gatherer` belongs to one stage worker: the worker tells it when a session's chunk is
read (``note_arrival``), when a forward ended (``note_forward``) and when a session ended
(``forget``), and awaits ``wait`` on its queue before each forward.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TypeVar

import trio

from swarm.errors import BadMessage
from swarm.model.stage import Stage
from swarm.node.ring.codec import is_replay
from swarm.proto.messages import Chunk, Message

GATHER_MAX_S = 0.1  # the longest a forward waits for sessions due (module doc)
GATHER_MERGE_MAX_S = 0.25  # the longest a smaller group waits to merge with the others

T = TypeVar("T")


Inbound = Message | BadMessage  # what a stage reads off its inbound link: a message, or why a frame was none


def session_of(item: Inbound) -> int:
    """The session an inbound item belongs to (0: none, a swarm-level message)."""
    return getattr(item, "session", 0)  # type: ignore[no-any-return]


def drain(recv: trio.MemoryReceiveChannel[Inbound], pending: deque[Inbound]) -> None:
    """Everything read so far into ``pending``, without waiting."""
    while True:
        try:
            pending.append(recv.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return


async def hand_off(chan: trio.MemorySendChannel[T] | None, item: T) -> None:
    """A reader's hand-off: ``item`` into ``chan`` (unbounded; None: nobody wants it any more),
    then a yield (the fast path's hot receive never yields, so a reader must). A task that was
    waiting for it runs before the reader's next receive: trio runs a batch of ready tasks in
    random order, and half the time that receive (nothing there yet: a failed read and a wait
    registered, in a process that sat idle, ~0.05-0.1 ms) ran first, on the message's way to its
    forward; a second checkpoint puts it a batch later. A busy receiver (frames queue while it
    computes) gets no second one: the reader drains a burst as fast as before."""
    woke = chan is not None and chan.statistics().tasks_waiting_receive > 0
    if chan is not None:
        chan.send_nowait(item)
    await trio.lowlevel.checkpoint()
    if woke:
        await trio.lowlevel.checkpoint()


@dataclass
class GatherStats:
    """What the waits cost (the stage's stats extend these; status shows them)."""

    gathers: int = 0  # forwards that waited for sessions due
    merges: int = 0  # ... of them, a smaller group waiting for the others
    gather_s: float = 0.0  # time spent waiting
    gather_timeouts: int = 0  # waits that ended at their deadline, someone waited for still missing


class Gatherer:
    """Which sessions the next forward of ``stage`` waits for, and the wait (module doc)."""

    def __init__(self, stage: Stage, stats: GatherStats, max_batch: int) -> None:
        self.stage = stage
        self.stats = stats
        self.max_batch = max_batch
        self.enabled = True
        self.typical_s = math.inf  # a small forward's running mean time: the gathering window
        self.arrived: dict[int, float] = {}  # session -> trio time its last chunk was read
        self.cycle: dict[int, float] = {}  # session -> its last inter-arrival time here
        self.mates: dict[int, tuple[frozenset[int], float]] = {}  # session -> its last forward's sessions, end

    def note_arrival(self, session: int) -> None:
        now = trio.current_time()
        last = self.arrived.get(session)
        if last is not None:
            self.cycle[session] = now - last
        self.arrived[session] = now

    def note_forward(self, sessions: frozenset[int], took: float, small: bool) -> None:
        """A forward of ``sessions`` ended, taking ``took`` s (``small``: few tokens, a window sample)."""
        if small:
            t = self.typical_s
            self.typical_s = took if t == math.inf else 0.8 * t + 0.2 * took
        ended = trio.current_time()
        for session in sessions:
            self.mates[session] = (sessions, ended)

    def forget(self, session: int) -> None:
        for state in (self.arrived, self.cycle, self.mates):
            state.pop(session, None)

    def due(self, pending: deque[Inbound]) -> set[int]:
        """Sessions that shared the queued ones' last forward, not queued yet (module doc)."""
        queued = {session_of(m) for m in pending}
        due: set[int] = set()
        for session in queued:  # a forward's sessions come back together...
            mates, ended = self.mates.get(session, (frozenset(), math.inf))
            if self.arrived.get(session, -math.inf) > ended:  # ...(not a chunk sent before it ended)
                due.update(mates)
        return (due - queued) & set(self.stage.sessions())

    def minority_waits(self, queued: set[int]) -> tuple[set[int], float]:
        """The active sessions this forward should wait for to merge with, and how long: the
        queued group waits for the others if it is the smaller one (a tie: the group without the
        lowest session id), until the last of them is expected (module doc)."""
        now = trio.current_time()
        open_here = set(self.stage.sessions())
        active = {s for s, c in self.cycle.items() if s in open_here and now - self.arrived[s] < 2 * c}
        others = active - queued
        if not others or not queued:
            return set(), 0.0
        if any(self.arrived.get(s, -math.inf) <= self.mates.get(s, ((), -math.inf))[1] for s in queued):
            return set(), 0.0  # a second chunk in flight, sent before its session's last forward ended
        if len(queued) > len(others) or (len(queued) == len(others) and min(queued) < min(others)):
            return set(), 0.0
        until = max(self.arrived[s] + self.cycle[s] for s in others)  # when the last is expected
        # wherever they are in the ring, they are back here within one of their cycles: a wait
        # bounded only by the estimate timed out when they ran late, and the groups stayed split
        return others, min(max(until - now, max(self.cycle[s] for s in others)), GATHER_MERGE_MAX_S)

    async def wait(self, recv: trio.MemoryReceiveChannel[Inbound], pending: deque[Inbound]) -> None:
        """Wait (bounded) for the sessions due about now, reading into ``pending``, so they share
        the next forward."""
        window = min(self.typical_s, GATHER_MAX_S)
        if not self.enabled or window == math.inf or not pending:
            return
        queued = {m.session for m in pending if isinstance(m, Chunk)}
        if not queued or len(queued) >= self.max_batch:
            return
        if any(isinstance(m, Chunk) and is_replay(m.chunk_id) for m in pending):
            return  # a resumed run's replay: computed at once (module doc)
        due = self.due(pending)
        if not due:
            due, window = self.minority_waits(queued)
            if not due or window == math.inf:
                return
            self.stats.merges += 1
        t0 = trio.current_time()
        with trio.move_on_after(window) as scope:
            while due and len(queued) < self.max_batch:
                try:
                    item = await recv.receive()
                except trio.EndOfChannel:
                    break
                pending.append(item)
                drain(recv, pending)
                queued.update(m.session for m in pending if isinstance(m, Chunk))
                due -= {session_of(m) for m in pending}
        self.stats.gathers += 1
        self.stats.gather_timeouts += scope.cancelled_caught
        self.stats.gather_s += trio.current_time() - t0
