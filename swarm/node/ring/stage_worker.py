"""One stage of the ring: verify chunks in from upstream, through its layer block, out downstream.

Theory of operation
-------------------
A stage worker owns one ``Stage`` (layers [start, end)) for one plan epoch and two links: the
inbound one from the previous hop and the outbound one to the next (the tail's next hop is the
coordinator). Two tasks share it:

- the *reader* drains the inbound link into an unbounded queue as fast as frames come, so the
  upstream peer never waits on our compute (its sends do not stall, a libp2p stream is never
  left unread) and the trio loop stays free for heartbeats and control messages; what it holds
  is bounded upstream instead: a session has at most its prefill window of pieces (or a decode
  step's few chunks) in flight on the whole ring (coordinator.py), which the budget counts. The
  reader holds a session to twice that (MAX_QUEUED_TOKENS): a chunk that would queue more of one
  session's tokens is refused (answered with an ERROR in its turn, as a bad frame), so an upstream
  that ignores the window (a faulty or hostile coordinator) fails its own sessions, never this
  node's memory or the other sessions;
- the *compute loop* takes a *batch* from the queue and runs it as one forward.

Batches (continuous batching). Frames of one session must be handled in arrival order (every
hop is FIFO, which is what makes speculative rollback simple); frames of different sessions are
independent (each has its own KV cache and positions). So a batch takes, scanning the queue in
order, at most one CHUNK per session: the first frame of each session not yet in the batch. A
later frame of a session already in the batch waits for the next round, as does everything after
it of that session. Control frames met on the way (SESSION_END, ROLLBACK, ERROR) are handled at
once, being their session's next frame; but a SESSION_END behind its session's waiting chunks
(its client hung up mid-prefill, or it finished with chunks in flight) drops them, computed for
nobody, and frees the session at once, before a later session's first chunk finds the table still
full (a refusal that once failed runs and re-planned a loaded ring over and over; a full table
is now refused as ``sessions_full``, the request alone). Sessions therefore join and leave the batch between
forwards, and a long prompt (prefilled in ``prefill_chunk`` pieces by the coordinator) takes one
piece per round, so it never stalls the others' decoding by more than one piece's compute.
Results go downstream in batch order; per session that is arrival order.

Gathering (what keeps sessions in one batch): before a forward the worker may wait, bounded,
for sessions on their way (gathering.py).

Replay (after a re-plan the coordinator replays a run's fed chunks, coordinator.py): a session's
consecutive queued replay chunks (ids from REPLAY_ID_BASE) are taken together and computed in one
call (``Stage.forward_seq``: bit for bit the chunks one by one, layer by layer), with no gathering
wait; their results go on in order. A group is at most as long as the session's replay so far
here (1, 1, 2, 4, ... up to REPLAY_GROUP chunks), so the next stage gets its first chunk after
one chunk's compute, not a whole group's, and the stages work in step (a pipeline).

Per chunk (session, chunk id, base position ``pos``, T hidden states): the session's cache is
first truncated to ``pos`` (this drops tokens the coordinator rejected after the previous chunk
was sent), then the block runs, and the result goes downstream with the same header. A stage
that holds fewer than ``pos`` positions cannot run the chunk (its context is missing): it reports
an ERROR downstream instead. The first chunk of a session (``pos == 0``) opens its cache.
SESSION_END frees the session's cache and travels on; ERROR and ROLLBACK travel on too, so
whatever a stage reports reaches the coordinator through the tail.

A session's state here (its KV cache, its gathering and replay figures) is freed on every path
its session ends by: SESSION_END, a forward out of memory (the session fails), the worker's end
(its epoch over: the sessions *it* opened, not a newer epoch's on the same kept ``Stage``), and a
session none of whose chunks came for ``idle_s`` (its coordinator gave up on it long before,
coordinator.py waits at most SLOW_WAIT_FACTOR chunk timeouts, and its SESSION_END never came: a
send that timed out on a loaded box). Such an eviction is logged and counted (status
``stage.evicted``); ``held()`` is what the worker holds now (status ``held``), so a leak shows
as a count that does not come back to zero.

The tail sends RESULT(kind="hidden") frames: the coordinator holds the final norm and LM head, and
D hidden values per token are far smaller than V logits.

Liveness never waits on compute. A forward runs in a worker thread behind one limiter per
process (``swarm.model.batched.forward_many``), except a batch predicted to take under
INLINE_MAX_S, or one session's small chunk alone in its batch whose typical forward takes under
LONE_INLINE_MAX_S, which run on the trio thread (``swarm.model.batched.InlinePolicy``: a thread
hand-off costs 0.2 ms idle and several ms on a loaded box). The lone case is the ring's
latency-bound one: the same forward ran ~13% slower in a worker thread than in the thread that
received it (bundled model, two stages: 26.8 and 21.4 ms in the nodes against 23.6 and 18.4 ms
in plain processes on pipes, benchmarks/pipeline_floor.py; LAN ring ÷ one process 0.81 -> 0.86,
one API session 15.8 -> 17.8 tok/s, concurrent sessions' total unchanged). The loop checkpoints
after every inline forward, so it is never held longer than about LONE_INLINE_MAX_S by compute
(``swarm.node.loopwatch`` measures the longest hold; the fast-path sockets' hot path does not pass
through the scheduler by itself). A loop held 50 ms is 2% of the failure detector's patience.

Bad input from the upstream peer (a malformed frame, a NaN activation, a wrong shape or epoch)
never reaches the model: the chunk is answered with an ERROR naming the peer and the field, and
the worker keeps serving the other sessions.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trio

from swarm.errors import (
    BadMessage,
    PeerLost,
    PeerTimeout,
    ProtocolError,
    RequestRefused,
    SwarmError,
)
from swarm.model.batched import SMALL_TOKENS, InlinePolicy, forward_many
from swarm.model.speculative import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WINDOW
from swarm.model.stage import Stage
from swarm.node.compute import memory
from swarm.node.compute.runtime import Compute
from swarm.node.errors_util import unwrap
from swarm.node.ring.codec import (
    Encoded,
    encode_hidden,
    hidden_chunk,
    hidden_result,
    is_replay,
    read_hidden,
)
from swarm.node.ring.coordinator import DEFAULT_CHUNK_TIMEOUT_S, SLOW_WAIT_FACTOR
from swarm.node.ring.gathering import Gatherer, GatherStats, Inbound, drain, hand_off, session_of
from swarm.node.ring.links import Link
from swarm.proto.messages import Chunk, Error, Message, Result, Rollback, SessionEnd, message_name

log = logging.getLogger("swarm.node.stage")

MAX_BATCH = 16  # sessions in one forward
MAX_BATCH_TOKENS = 512  # tokens in one forward (a prefill piece is 64 by default)
REPLAY_GROUP = 16  # the most replay chunks of a session computed in one call (module doc: replay)
# one session's tokens read and not yet handled, at most (module doc: the reader): twice its window
MAX_QUEUED_TOKENS = 2 * DEFAULT_PREFILL_WINDOW * DEFAULT_PREFILL_CHUNK
IDLE_POLL_S = 5.0  # an idle inbound link is fine; we only wake to notice cancellation
SEND_TIMEOUT_S = 10.0


def session_idle_limit(chunk_timeout: float) -> float:
    """How long a stage keeps a session none of whose chunks came: twice the longest its
    coordinator waits for one result (``chunk_timeout`` times SLOW_WAIT_FACTOR, coordinator.py),
    so a session it still waits for is never freed."""
    return 2 * SLOW_WAIT_FACTOR * chunk_timeout


SESSION_IDLE_S = session_idle_limit(DEFAULT_CHUNK_TIMEOUT_S)


@dataclass
class StageStats(GatherStats):
    chunks: int = 0
    tokens: int = 0
    errors: int = 0
    compute_s: float = 0.0
    batches: int = 0
    max_batch: int = 0  # the most sessions computed in one forward
    batched_chunks: int = 0  # chunks that shared a forward with another session's
    sizes: list[int] = field(default_factory=list)  # sizes[k]: forwards of k + 1 sessions
    replayed: int = 0  # replay chunks computed (module doc: replay)
    replay_groups: int = 0  # ... in this many calls
    max_queued: int = 0  # the most messages read and not yet handled at once (module doc: the reader)
    evicted: int = 0  # sessions freed after ``idle_s`` with no chunk and no SESSION_END (module doc)


class StageWorker:
    def __init__(
        self,
        stage: Stage,
        *,
        epoch: int,
        upstream: str,
        is_tail: bool,
        max_sessions: int = 64,
        max_len: int | None = None,
        compute: Compute,
        on_bad_input: Callable[[str, str], None] | None = None,
        compute_delay_s: float = 0.0,
        max_batch: int = MAX_BATCH,
        max_queued_tokens: int = MAX_QUEUED_TOKENS,
        corrupt_after: int | None = None,
        idle_s: float = SESSION_IDLE_S,
    ) -> None:
        self.stage = stage
        self.epoch = epoch
        self.upstream = upstream
        self.is_tail = is_tail
        self.max_sessions = max_sessions
        self.max_len = max_len or stage.args.max_seq_len
        self.compute = compute  # where a forward not predicted quick runs (runtime.py)
        # bad activations are reported to the leader by us, the receiving end of the hop: an
        # in-band ERROR naming a peer is only a claim that any stage on the way could forge
        self.on_bad_input = on_bad_input
        self._reported = False
        self.dtype = next(stage.parameters()).dtype
        self.stats = StageStats()
        self.max_batch = max(1, max_batch)
        self.placing = InlinePolicy()  # where a forward runs: the trio thread or a worker (model/batched.py)
        self.corrupt_after = corrupt_after  # fault injection for chaos tests: NaN after N chunks
        self.swallow = False  # fault injection: drop every frame read (a hop that silently stopped)
        # fault injection for load tests: every forward blocks this much longer (a blocking sleep
        # inside the compute, as a busy box's compute does), wherever the forward runs
        self.compute_delay_s = compute_delay_s
        self._pending: deque[Inbound] = deque()  # read, not yet handled (sessions busy in a batch)
        self.max_queued_tokens = max_queued_tokens
        self._queued: dict[int, int] = {}  # session -> its chunks' tokens read, not yet handled
        self.gathering = Gatherer(stage, self.stats, self.max_batch)  # waits for sessions due (gathering.py)
        self._replayed: dict[int, int] = {}  # session -> replay chunks computed (module doc: replay)
        self._opened: set[int] = set()  # the sessions this worker opened and has not freed (module doc)
        self.idle_s = idle_s  # a session with no chunk this long is freed (module doc)
        self._next_sweep = -math.inf
        self.trace: list[list[tuple[int, int, int]]] | None = None  # tests: (session, pos, tokens) per batch

    def __repr__(self) -> str:
        return f"StageWorker([{self.stage.start}, {self.stage.end}), epoch={self.epoch})"

    async def serve(self, inbound: Link, outbound: Link) -> None:
        """Run until the inbound link closes (PeerLost) or the caller cancels."""
        send, recv = trio.open_memory_channel[Inbound](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, inbound, send)
                await self._compute_loop(recv, outbound)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            exc = unwrap(eg)
            if not isinstance(exc, PeerLost):
                raise exc from None
            log.info("%r: downstream link closed: %s", self, exc)
        except PeerLost as exc:
            log.info("%r: downstream link closed: %s", self, exc)
        finally:  # ours only: a newer epoch's worker may already serve on this same Stage (kept block)
            for session in list(self._opened):
                self._free(session)

    def held(self) -> dict[str, int]:
        """What this worker holds now (status ``held``): the sessions it opened, the stage's KV
        cache bytes, messages read and not yet handled and their chunks' tokens, and the sessions
        the gathering keeps figures for; all back to zero once every session ended."""
        return {"sessions": len(self._opened), "kv_bytes": self.stage.kv_bytes(), "queued": len(self._pending),
                "queued_tokens": sum(self._queued.values()), "tracked": len(self.gathering.arrived)}  # fmt: skip

    def _free(self, session: int) -> None:
        """Everything this worker holds for ``session`` (module doc: freed on every path)."""
        self.stage.close_session(session)
        self._opened.discard(session)
        self.gathering.forget(session)
        self._replayed.pop(session, None)

    def _evict_idle(self) -> None:
        """Free the sessions none of whose chunks came for ``idle_s`` (and none waits here);
        looked at every IDLE_POLL_S at most, between forwards (module doc)."""
        now = trio.current_time()
        if now < self._next_sweep:
            return
        self._next_sweep = now + IDLE_POLL_S
        waiting = {session_of(m) for m in self._pending}
        for session in [s for s in self._opened if s not in waiting]:
            if now - self.gathering.arrived.get(session, -math.inf) >= self.idle_s:
                log.warning("%r: session %d sent nothing for %.0f s and never ended: its cache is freed",
                            self, session, self.idle_s)  # fmt: skip
                self._free(session)
                self.stats.evicted += 1

    async def _read(self, inbound: Link, send: trio.MemorySendChannel[Inbound]) -> None:
        async with send:
            try:
                while True:
                    item: Inbound
                    try:
                        item = await inbound.receive_message(timeout=IDLE_POLL_S)
                    except PeerTimeout:
                        continue
                    except BadMessage as exc:  # answered in its turn with an ERROR (_take_batch)
                        item = exc
                    if not self.swallow:
                        if isinstance(item, Chunk):
                            item = self._enqueue(item)
                        if isinstance(item, Chunk):
                            self.gathering.note_arrival(item.session)
                        queued = send.statistics().current_buffer_used + 1 + len(self._pending)
                        self.stats.max_queued = max(self.stats.max_queued, queued)
                    # unbounded: what is in flight is bounded upstream; the compute loop first (gathering.py)
                    await hand_off(None if self.swallow else send, item)
            except PeerLost:
                log.info("%r: upstream %s closed", self, self.upstream)

    def _enqueue(self, chunk: Chunk) -> Chunk | BadMessage:
        """Count a chunk read against its session's bound, or refuse it (module doc: the reader)."""
        held = self._queued.get(chunk.session, 0) + chunk.tokens
        if held > self.max_queued_tokens:
            return BadMessage(
                f"peer {self.upstream}: session {chunk.session}'s chunk {chunk.chunk_id} would queue {held} of its "
                f"tokens at stage [{self.stage.start}, {self.stage.end}), over the {self.max_queued_tokens} its "
                "prefill window allows", session=chunk.session, seq=chunk.chunk_id)  # fmt: skip
        self._queued[chunk.session] = held
        return chunk

    def _dequeue(self, chunk: Chunk) -> None:
        left = self._queued.pop(chunk.session, 0) - chunk.tokens
        if left > 0:
            self._queued[chunk.session] = left

    async def _compute_loop(self, recv: trio.MemoryReceiveChannel[Inbound], outbound: Link) -> None:
        while True:
            self._evict_idle()
            if not self._pending:
                try:
                    with trio.move_on_after(IDLE_POLL_S):  # idle: wake now and then to evict (module doc)
                        self._pending.append(await recv.receive())
                except trio.EndOfChannel:
                    return
                if not self._pending:
                    continue
            drain(recv, self._pending)
            await self.gathering.wait(recv, self._pending)
            batch = await self._take_batch(outbound)
            if batch:
                await self._run_batch(batch, outbound)
            await trio.lowlevel.checkpoint()

    async def _take_batch(self, outbound: Link) -> list[list[tuple[Chunk, torch.Tensor]]]:
        """Scan the queue in order: each session's first message is handled (a control message,
        or a frame that was none) or joins the batch (a chunk, with the replay chunks queued
        behind it if it is one); later messages of a session in the batch wait (module doc)."""
        batch: list[list[tuple[Chunk, torch.Tensor]]] = []
        busy: set[int] = set()
        keep: deque[Inbound] = deque()
        tokens = 0
        while self._pending:
            msg = self._pending.popleft()
            session = session_of(msg)
            if isinstance(msg, SessionEnd) and session in busy:  # over: what it queued is for nobody
                batch, keep = self._drop_session(session, batch, keep)
                busy.discard(session)
                tokens = sum(m.tokens for g in batch for m, _ in g)
            if session in busy or len(batch) >= self.max_batch:
                keep.append(msg)
                busy.add(session)
                continue
            if isinstance(msg, BadMessage):
                self.stats.errors += 1
                log.warning("%r: bad frame from %s: %s", self, self.upstream, msg)
                await self._report(outbound, msg.session, msg.seq, "bad_frame", str(msg))
                continue
            if not isinstance(msg, Chunk):
                await self._control(msg, outbound)
                continue
            if batch and tokens + msg.tokens > MAX_BATCH_TOKENS:
                keep.append(msg)
                busy.add(session)
                continue
            self._dequeue(msg)
            h = await self._admit(msg, outbound)
            if h is not None:
                group = self._replay_group(msg, h, MAX_BATCH_TOKENS - tokens) if is_replay(msg.chunk_id) else [(msg, h)]
                batch.append(group)
                busy.add(msg.session)
                tokens += sum(m.tokens for m, _ in group)
            if self._pending:  # one frame per step: heartbeats run in between (not after the last:
                await trio.lowlevel.checkpoint()  # the batch's sends checkpoint, after its forward)
        self._pending = keep
        return batch

    def _drop_session(self, session: int, batch: list[list[tuple[Chunk, torch.Tensor]]], keep: deque[Inbound],
                      ) -> tuple[list[list[tuple[Chunk, torch.Tensor]]], deque[Inbound]]:  # fmt: skip
        """A session whose SESSION_END is read while its chunks wait (in this batch, not yet run, or
        kept for the next): its coordinator ended it, so they are computed for nobody; they go, and
        the SESSION_END is handled now, freeing its cache before any later session's first chunk
        (which would otherwise find the table still full: module doc)."""
        for msg in keep:
            if isinstance(msg, Chunk) and msg.session == session:
                self._dequeue(msg)
        return ([g for g in batch if g[0][0].session != session],
                deque(m for m in keep if session_of(m) != session))  # fmt: skip

    def _replay_group(self, first: Chunk, h: torch.Tensor, room: int) -> list[tuple[Chunk, torch.Tensor]]:
        """``first``, an admitted replay chunk, and its session's next queued replay chunks while
        each is sound and starts within what the ones before hold (up to REPLAY_GROUP chunks and
        ``room`` tokens); one that is not stays queued and is handled (reported) on its own."""
        group, end, tokens = [(first, h)], first.pos + first.tokens, first.tokens
        done = self._replayed.get(first.session, 0)
        self._replayed[first.session] = done + 1
        while len(group) < min(REPLAY_GROUP, max(1, done)):
            i = next((i for i, m in enumerate(self._pending) if session_of(m) == first.session), None)
            msg = None if i is None else self._pending[i]
            if i is None or not isinstance(msg, Chunk) or not is_replay(msg.chunk_id):
                break
            if msg.epoch != self.epoch or msg.pos > end:
                break
            if msg.pos + msg.tokens > self.max_len or tokens + msg.tokens > room:
                break
            try:
                group.append((msg, read_hidden(msg, dim=self.stage.args.dim, expect=self.dtype, peer=self.upstream)))
            except SwarmError:
                break
            del self._pending[i]
            self._dequeue(msg)
            end, tokens = msg.pos + msg.tokens, tokens + msg.tokens
            self._replayed[first.session] += 1
        return group

    async def _control(self, msg: Message, outbound: Link) -> None:
        """A session's next message that is no chunk: acted on here and passed on (SESSION_END,
        ROLLBACK: the stages after us hold the session too; ERROR: for the coordinator)."""
        if isinstance(msg, SessionEnd):
            self._free(msg.session)
            if not self.is_tail:
                await outbound.send_message(msg, timeout=SEND_TIMEOUT_S)
        elif isinstance(msg, Rollback):
            if msg.session in self.stage.sessions() and self.stage.session_len(msg.session) > msg.length:
                self.stage.rollback(msg.session, msg.length)
            if not self.is_tail:
                await outbound.send_message(msg, timeout=SEND_TIMEOUT_S)
        elif isinstance(msg, Error):
            await outbound.send_message(msg, timeout=SEND_TIMEOUT_S)
        else:  # a RESULT, a swarm-level message (session 0: not answered)
            chunk_id = msg.chunk_id if isinstance(msg, Result) else 0
            await self._report(
                outbound, session_of(msg), chunk_id, "unexpected", f"{message_name(msg)} on the activation path"
            )

    async def _admit(self, msg: Chunk, outbound: Link) -> torch.Tensor | None:
        """Check a chunk and make its session's cache ready; None (reported downstream) if bad."""
        where = f"stage [{self.stage.start}, {self.stage.end})"
        try:
            if msg.epoch != self.epoch:
                raise ProtocolError(f"chunk for epoch {msg.epoch}, {where} serves epoch {self.epoch}")
            h = read_hidden(msg, dim=self.stage.args.dim, expect=self.dtype, peer=self.upstream)
        except SwarmError as exc:  # the upstream peer sent bad activations: name it as faulty
            self.stats.errors += 1
            log.warning("%r: bad activations from %s: %s", self, self.upstream, exc)
            await self._report(outbound, msg.session, msg.chunk_id, "bad_input", f"upstream={self.upstream} {exc}")
            if self.on_bad_input is not None and not self._reported:  # once: the leader re-plans
                self._reported = True
                self.on_bad_input(self.upstream, str(exc))
            return None
        if msg.pos + msg.tokens > self.max_len:  # this request is over the context: it fails alone
            log.warning("%r: refused chunk %d of session %d: over the context", self, msg.chunk_id, msg.session)
            await self._report(outbound, msg.session, msg.chunk_id, "context_exceeded",
                               f"{where}: positions up to {msg.pos + msg.tokens} exceed the context of {self.max_len}")
            return None
        try:
            self._prepare_cache(msg, where)
        except RequestRefused as exc:  # this request alone fails (coordinator.py REQUEST_ERRORS): no re-plan
            log.warning("%r: refused chunk %d of session %d: %s", self, msg.chunk_id, msg.session, exc)
            await self._report(outbound, msg.session, msg.chunk_id, "sessions_full", str(exc))
            return None
        except SwarmError as exc:
            self.stats.errors += 1
            log.warning("%r: refused chunk %d of session %d: %s", self, msg.chunk_id, msg.session, exc)
            await self._report(outbound, msg.session, msg.chunk_id, "bad_chunk", str(exc))
            return None
        return h

    def _forward(self, batch: list[list[tuple[Chunk, torch.Tensor]]]) -> tuple[list[Encoded], float]:
        """The batch's forward and its outputs' encoding, in one go (in the worker thread, so the
        trio loop makes no torch call per result: each would wait for the GIL behind the compute);
        the outputs in batch order, a replay group's chunk by chunk."""
        t0 = time.perf_counter()
        if self.compute_delay_s > 0:
            time.sleep(self.compute_delay_s)  # fault injection: compute that blocks (module doc)
        if memory.INJECT_OOM_TOKENS:  # a test hook (memory.py), off unless the environment sets it
            memory.check_forward(max(m.tokens for g in batch for m, _ in g))
        # encoding copies to the CPU: on a GPU that waits for the kernels here, so the time is the
        # work's and the trio loop never blocks on the device
        items = [(g[0][0].session, g[0][1]) for g in batch if len(g) == 1]
        singles = forward_many(self.stage, items) if items else []
        outs: list[torch.Tensor] = []
        for group in batch:
            if len(group) == 1:
                outs.append(singles.pop(0))
            else:  # a replay group: bit for bit its chunks one by one (Stage.forward_seq)
                outs.extend(self.stage.forward_seq(group[0][0].session, [(m.pos, h) for m, h in group]))
        if self.corrupt_after is not None and self.stats.chunks >= self.corrupt_after:
            outs = [torch.full_like(o, float("nan")) for o in outs]  # fault injection (chaos tests): a broken peer
        return [encode_hidden(o) for o in outs], time.perf_counter() - t0

    async def _run_batch(self, groups: list[list[tuple[Chunk, torch.Tensor]]], outbound: Link) -> None:
        try:
            await self._compute_batch(groups, outbound)
        except memory.OOM_ERRORS as exc:
            await self._out_of_memory(groups, outbound, exc)

    async def _out_of_memory(self, groups: list[list[tuple[Chunk, torch.Tensor]]], outbound: Link,
                             exc: BaseException) -> None:  # fmt: skip
        """A forward ran out of memory (node/compute/memory.py): its sessions' caches are rolled back to
        where the batch began; a batch of several sessions is tried again one session at a time,
        and a session that runs out alone fails (an ERROR ``out_of_memory`` to the coordinator,
        its cache here dropped). Everything else on this stage goes on as before."""
        memory.release(str(self.stage.device))
        for group in groups:
            first = group[0][0]
            if first.session in self.stage.sessions() and self.stage.session_len(first.session) > first.pos:
                self.stage.rollback(first.session, first.pos)
        if len(groups) > 1:
            for group in groups:
                await self._run_batch([group], outbound)
            return
        session = groups[0][0][0].session
        self.stats.errors += 1
        log.warning("%r: session %d: %s", self, session, memory.describe(exc))
        self._free(session)
        where = f"stage [{self.stage.start}, {self.stage.end})"
        for msg, _ in groups[0]:
            await self._report(outbound, session, msg.chunk_id, "out_of_memory", f"{where}: {memory.describe(exc)}")

    async def _compute_batch(self, groups: list[list[tuple[Chunk, torch.Tensor]]], outbound: Link) -> None:
        batch = [c for g in groups for c in g]  # every chunk, in batch order
        if self.trace is not None:
            self.trace.append([(m.session, m.pos, m.tokens) for m, _ in batch])
        calls = max(len(g) for g in groups)  # a replay group costs a forward per chunk
        small = calls == 1 and sum(m.tokens for m, _ in batch) <= SMALL_TOKENS
        if not self.compute.threads or self.placing.inline(calls=calls, small=small, lone=len(batch) == 1):
            outs, took = self._forward(groups)
        else:
            outs, took = await self.compute.to_thread(self._forward, groups)
        self.placing.note(took, calls=calls, small=small)
        if calls > 1:
            self.stats.replay_groups += sum(len(g) > 1 for g in groups)
        self.stats.replayed += sum(is_replay(m.chunk_id) for m, _ in batch)
        self.gathering.note_forward(frozenset(m.session for m, _ in batch), took, small)
        st = self.stats
        st.compute_s += took
        st.batches += 1
        st.max_batch = max(st.max_batch, len(groups))
        st.sizes.extend([0] * (len(groups) - len(st.sizes)))
        st.sizes[len(groups) - 1] += 1
        if len(groups) > 1:
            st.batched_chunks += len(groups)
        for (msg, _), enc in zip(batch, outs, strict=True):
            st.chunks += 1
            st.tokens += msg.tokens
            reply: Chunk | Result
            if self.is_tail:
                reply = hidden_result(msg.session, msg.chunk_id, msg.pos, enc, msg.epoch)
            else:
                reply = hidden_chunk(msg.session, msg.chunk_id, msg.pos, msg.mode, enc, msg.epoch, msg.flags)
            await outbound.send_message(reply, timeout=SEND_TIMEOUT_S)
            await trio.lowlevel.checkpoint()  # the fast path's hot send never yields

    def _prepare_cache(self, msg: Chunk, where: str) -> None:
        session = msg.session
        if session not in self.stage.sessions():
            if msg.pos != 0:
                raise ProtocolError(f"{where}: session {session} unknown and chunk starts at {msg.pos}")
            if len(self._opened) >= self.max_sessions:  # ours: an ended epoch's still unwinding are not
                raise RequestRefused(f"{where}: {self.max_sessions} sessions open (limit max_sessions)")
            self.stage.open_session(session, self.max_len)
            self._opened.add(session)
        held = self.stage.session_len(session)
        if held < msg.pos:
            raise ProtocolError(
                f"{where}: chunk {msg.chunk_id} starts at position {msg.pos} but only {held} are cached"
            )
        if msg.pos + msg.tokens > self.max_len:
            raise ProtocolError(f"{where}: positions up to {msg.pos + msg.tokens} exceed max_len {self.max_len}")
        if held > msg.pos:
            self.stage.rollback(session, msg.pos)

    async def _report(self, outbound: Link, session: int, chunk_id: int, code: str, text: str) -> None:
        if session == 0:
            return
        try:
            await outbound.send_message(Error(session, chunk_id, code, text[:1000]), timeout=SEND_TIMEOUT_S)
        except SwarmError as exc:
            log.warning("%r: could not report error downstream: %s", self, exc)
