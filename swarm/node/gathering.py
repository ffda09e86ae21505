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

``Gathering`` is the stage worker's part that decides this (a mixin of ``StageWorker``: it
shares the worker's queue, its arrival times and its statistics).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import trio

from swarm.node.activation import is_replay
from swarm.proto.frame import Frame, MsgType

if TYPE_CHECKING:
    from swarm.model.stage import Stage
    from swarm.node.stage_worker import StageStats

GATHER_MAX_S = 0.1  # the longest a forward waits for sessions due (module doc)
GATHER_MERGE_MAX_S = 0.25  # the longest a smaller group waits to merge with the others


class Gathering:
    stage: Stage
    stats: StageStats
    gather: bool
    max_batch: int
    _typical_s: float
    _pending: deque[Frame]
    _arrived: dict[int, float]  # session -> trio time its last chunk was read
    _cycle: dict[int, float]  # session -> its last inter-arrival time here
    _mates: dict[int, tuple[frozenset[int], float]]  # session -> its last forward's sessions, end

    def _drain(self, recv: trio.MemoryReceiveChannel[Frame]) -> None:
        """Everything read so far into the queue, without waiting."""
        while True:
            try:
                self._pending.append(recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return

    def _note_arrival(self, session: int) -> None:
        now = trio.current_time()
        last = self._arrived.get(session)
        if last is not None:
            self._cycle[session] = now - last
        self._arrived[session] = now

    def _due(self) -> set[int]:
        """Sessions that shared the queued ones' last forward, not queued yet (module doc)."""
        queued = {f.session for f in self._pending}
        due: set[int] = set()
        for session in queued:  # a forward's sessions come back together...
            mates, ended = self._mates.get(session, (frozenset(), math.inf))
            if self._arrived.get(session, -math.inf) > ended:  # ...(not a chunk sent before it ended)
                due.update(mates)
        return (due - queued) & set(self.stage.sessions())

    def _minority_waits(self, queued: set[int]) -> tuple[set[int], float]:
        """The active sessions this forward should wait for to merge with, and how long: the
        queued group waits for the others if it is the smaller one (a tie: the group without the
        lowest session id), until the last of them is expected (module doc)."""
        now = trio.current_time()
        open_here = set(self.stage.sessions())
        active = {s for s, c in self._cycle.items() if s in open_here and now - self._arrived[s] < 2 * c}
        others = active - queued
        if not others or not queued:
            return set(), 0.0
        if any(self._arrived.get(s, -math.inf) <= self._mates.get(s, ((), -math.inf))[1] for s in queued):
            return set(), 0.0  # a second chunk in flight, sent before its session's last forward ended
        if len(queued) > len(others) or (len(queued) == len(others) and min(queued) < min(others)):
            return set(), 0.0
        until = max(self._arrived[s] + self._cycle[s] for s in others)  # when the last is expected
        # wherever they are in the ring, they are back here within one of their cycles: a wait
        # bounded only by the estimate timed out when they ran late, and the groups stayed split
        return others, min(max(until - now, max(self._cycle[s] for s in others)), GATHER_MERGE_MAX_S)

    async def _gather(self, recv: trio.MemoryReceiveChannel[Frame]) -> None:
        """Wait (bounded) for the sessions due about now, so they share this forward."""
        window = min(self._typical_s, GATHER_MAX_S)
        if not self.gather or window == math.inf or not self._pending:
            return
        queued = {f.session for f in self._pending if f.msg_type == MsgType.CHUNK}
        if not queued or len(queued) >= self.max_batch:
            return
        if any(f.msg_type == MsgType.CHUNK and is_replay(f.seq) for f in self._pending):
            return  # a resumed run's replay: computed at once (module doc)
        due = self._due()
        if not due:
            due, window = self._minority_waits(queued)
            if not due or window == math.inf:
                return
            self.stats.merges += 1
        t0 = trio.current_time()
        with trio.move_on_after(window) as scope:
            while due and len(queued) < self.max_batch:
                try:
                    frame = await recv.receive()
                except trio.EndOfChannel:
                    break
                self._pending.append(frame)
                self._drain(recv)
                queued.update(f.session for f in self._pending if f.msg_type == MsgType.CHUNK)
                due -= {f.session for f in self._pending}
        self.stats.gathers += 1
        self.stats.gather_timeouts += scope.cancelled_caught
        self.stats.gather_s += trio.current_time() - t0
