"""The coordinator's side of the ring: embed, send verify chunks, take results, commit tokens.

Theory of operation
-------------------
The coordinator holds the embedding, the final norm and LM head, and (optionally) a drafter
(drafting.py: a draft model runs off this loop, and each chunk is sent as soon as it is drafted).
Each generation is a run of the decode driver (swarm/model/driver.py), the same driver the
in-process reference runs; the ring is its target: a chunk the driver sends is embedded and sent
on ``first`` (to ring[0]), and its result comes back on the link from the tail, read by one reader
task that dispatches RESULT/ERROR frames to the session they belong to. A live chunk's hidden
state goes through the LM head and its logits back to the driver.

Schedule (this is what makes the ring exactly reproducible): the driver's. Results come back in
send order (every hop is FIFO), and the driver polls its decoder after every result, live or
stale, so the chunks issued depend only on the results, never on timing: the ring and one box
(``swarm.model.generate``) compute the same chunks, hence the same numbers.

A prompt's pieces go out a window at a time (the decoder's ``prefill_window``, speculative.py):
the next piece when a piece's result is in, so no stage ever queues more than a window of one
session's hidden states (what the memory budget counts per session: planner/budget.py), and a
replay after a re-plan keeps to the same window of tokens. The bound is the ring's own results,
never back-pressure on a send: a stage's reader takes every frame as it comes, so no send waits
on a full queue and a loaded first stage is waited for as a busy ring (below), never timed out as
a dead one.

Several chunks may be in flight (the decoder's depth policy). A rejection discards later chunks:
stages still compute them, and their results are skipped here (no LM head work). An ERROR from
any stage or a lost link fails the generation with an error naming the peer, and the session is
closed on every stage.

Slow is not gone. Each wait for a result has a deadline (``chunk_timeout``), but a ring that
keeps delivering results, to any session, within that deadline is busy, not broken: the wait
goes on (a session queued behind seven others on a loaded ring may wait longer than one chunk's
deadline), up to SLOW_WAIT_FACTOR deadlines. Only a ring silent for a whole deadline times out.

Before its first decode chunk is polled (the prompt's prefill is out, the first result is in),
a run's ``before_decode`` hears how many other generations share the ring: a default prompt
lookup stands down then (drafting.py: sharing the ring).

The LM head is batched across sessions whose results arrive together (headbatch.py), and runs
off the trio loop unless predicted quick, so the loop answering heartbeats is never held long by
compute; the receipt counts ``shared_head_calls``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Unpack

import torch
import trio

from swarm.errors import (
    BadMessage,
    ContextTooLong,
    FaultyPeer,
    PeerError,
    PeerLost,
    PeerTimeout,
    ProtocolError,
    RequestRefused,
    SwarmError,
    UsageError,
)
from swarm.model.driver import Await, Decode, DecodeSettings, GenerationResult, Send, decoder_for
from swarm.model.speculative import SpeculativeDecoder, VerifyChunk
from swarm.model.stage import Head
from swarm.net.channel import FastLock
from swarm.node.compute import drafting, memory
from swarm.node.compute.headbatch import SharedHead
from swarm.node.compute.runtime import Compute
from swarm.node.ring.codec import REPLAY_ID_BASE, hidden_chunk, read_hidden
from swarm.node.ring.gathering import hand_off, session_of
from swarm.node.ring.links import Link
from swarm.proto.messages import Error, Message, Result, SessionEnd

log = logging.getLogger("swarm.node.ring.coordinator")

DEFAULT_CHUNK_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 10.0
# a stage's ERROR codes that fail only the request they name (no re-plan, no blame)
REQUEST_ERRORS: dict[str, type[SwarmError]] = {"context_exceeded": ContextTooLong, "out_of_memory": RequestRefused,
                                               "sessions_full": RequestRefused}
SLOW_WAIT_FACTOR = 10  # a busy ring (results flowing to other sessions) is waited for this many deadlines


class RingRun(Decode):
    """One generation's decoding (driver.py) with what a ring adds: where its drafter runs, a
    hook before decoding begins, and the ring's own figures. It outlives the ring it started on."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        *,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        draft_limiter: trio.CapacityLimiter | None = None,
        before_decode: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(decoder, on_tokens=on_tokens, on_progress=on_progress)
        self.draft_limiter = draft_limiter  # a model drafter's forwards (drafting.py)
        # called once, with the number of other generations on the ring, when the prompt's prefill is
        # out and before any decode chunk is polled (it may change the drafter: drafting.py, sharing)
        self.before_decode = before_decode
        self.shared_head_calls = 0  # LM head calls computed together with other sessions' rows
        self.traversal_ms: list[float] = []  # send -> result, per live chunk

    def result(self) -> GenerationResult:
        return dataclasses.replace(
            super().result(), shared_head_calls=self.shared_head_calls, traversal_ms=list(self.traversal_ms)
        )


class Coordinator:
    """Serves generations over one ring (one plan epoch)."""

    _session_ids = itertools.count(1)

    def __init__(
        self,
        head: Head,
        *,
        epoch: int,
        first_hop: str,
        chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT_S,
        compute: Compute,
        compute_delay_s: float = 0.0,
        max_len: int | None = None,
    ) -> None:
        self.head = head
        self.max_len = max_len  # the swarm's context (None: the model's own)
        self.args = head.args
        self.epoch = epoch
        self.first_hop = first_hop
        self.chunk_timeout = chunk_timeout
        self.dtype = next(head.parameters()).dtype
        self._sessions: dict[int, trio.MemorySendChannel[Message | SwarmError]] = {}
        # taken without a scheduler pass when free: a chunk the driver issues goes on the wire
        # before any other task runs (the token just streamed to the client, heartbeats), not
        # after a libp2p write half the time (trio runs a ready batch in random order)
        self._send_lock = FastLock()
        self._first: Link | None = None
        self._tail_peer = "?"
        self._broken: SwarmError | None = None
        self._last_result = -math.inf  # trio time the tail last delivered anything
        self.compute = compute  # where head calls and drafting run (runtime.py)
        self.shared_head = SharedHead(
            head, self.compute, live=self._sessions.keys, compute_delay_s=compute_delay_s
        )  # the LM head, batched across sessions (headbatch.py)

    # -- the result reader -----------------------------------------------------------------

    async def serve_results(self, inbound: Link, *, tail_peer: str) -> None:
        """Read RESULT/ERROR messages from the tail and hand them to their sessions."""
        self._tail_peer = tail_peer
        try:
            while True:
                item: Message | SwarmError
                try:
                    item = await inbound.receive_message(timeout=5.0)
                except PeerTimeout:
                    continue
                except BadMessage as exc:  # its session's error (the link is sound: others go on)
                    item = exc
                session = session_of(item)
                self._last_result = trio.current_time()
                chan = self._sessions.get(session)
                if chan is not None:  # (an ended session's figures would outlive it: forgotten at its end)
                    self.shared_head.note_result(session)
                # None: a session that already ended (its discarded chunks drain here); its task first (gathering.py)
                await hand_off(chan, item)
        except PeerLost as exc:
            self._fail_all(PeerLost(f"tail {tail_peer}: result link closed ({exc})"))
            raise

    def _fail_all(self, exc: SwarmError) -> None:
        self._broken = exc
        for chan in self._sessions.values():
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                chan.send_nowait(exc)

    def held(self) -> dict[str, int]:
        """What this coordinator holds now (status ``held``): its generations on this ring, results
        read and not yet taken by them, LM head requests queued, sessions the head batching keeps
        figures for; all back to zero once every generation ended."""
        return {"sessions": len(self._sessions),
                "results_queued": sum(c.statistics().current_buffer_used for c in self._sessions.values()),
                **self.shared_head.held()}  # fmt: skip

    def attach(self, first: Link) -> None:
        self._first = first

    # -- one generation -------------------------------------------------------------------

    def new_run(
        self,
        prompt_ids: Sequence[int],
        *,
        draft_limiter: trio.CapacityLimiter | None = None,
        before_decode: Callable[[int], None] | None = None,
        **settings: Unpack[DecodeSettings],
    ) -> RingRun:
        """The state of one generation; it outlives the epoch it started in (see drive)."""
        return RingRun(decoder_for(self.args, prompt_ids, self.max_len, settings), on_tokens=settings.get("on_tokens"),
                       on_progress=settings.get("on_progress"), draft_limiter=draft_limiter,
                       before_decode=before_decode)  # fmt: skip

    async def generate(self, prompt_ids: Sequence[int], **settings: Unpack[DecodeSettings]) -> GenerationResult:
        """One generation on this ring from start to end (no recovery: see drive)."""
        return await self.drive(self.new_run(prompt_ids, **settings))

    async def drive(self, run: RingRun) -> GenerationResult:
        """Run ``run`` on this ring until it finishes, or raise when the ring fails.

        This ring is the decode driver's target (driver.py). A run that already made progress on
        an earlier ring resumes exactly: the chunks it fed before are replayed first, with the
        same shapes in the same order, so every stage's cache holds bit-for-bit what it held
        before (results ignored), then the driver re-sends the chunks that were in flight, then
        decoding goes on.
        """
        if self._first is None:
            raise UsageError("coordinator has no ring attached")
        if self._broken is not None:
            raise self._broken
        session = next(self._session_ids)
        send_chan, recv_chan = trio.open_memory_channel[Message | SwarmError](math.inf)
        self._sessions[session] = send_chan
        sent: dict[int, tuple[VerifyChunk | None, float]] = {}
        steps = run.steps()
        try:
            if run.fed_log:
                await self._replay(run, session, sent, recv_chan)
            answer: int | torch.Tensor | None = None
            hidden, t_sent = torch.empty(0), 0.0  # the latest result's
            while True:
                try:
                    step = steps.send(answer)
                except StopIteration:
                    break
                if isinstance(step, Send):
                    await self._issue(run, step, session, sent)
                    answer = None
                elif isinstance(step, Await):
                    answer, hidden, t_sent = await self._answer(run, recv_chan, session, sent)
                else:
                    run.traversal_ms.append(1000 * (time.perf_counter() - t_sent))
                    answer = await self._logits(run, hidden[step.chunk.logits_from:], session)
        finally:
            steps.close()
            del self._sessions[session]
            self.shared_head.forget(session)
            with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                scope.shield = True
                try:
                    async with self._send_lock:
                        await self._first.send_message(SessionEnd(session), timeout=SEND_TIMEOUT_S)
                except SwarmError as exc:
                    log.info("session %d: could not send SESSION_END: %s", session, exc)
        return run.result()

    async def _answer(
        self, run: RingRun, chan: trio.MemoryReceiveChannel[Message | SwarmError], session: int,
        sent: dict[int, tuple[VerifyChunk | None, float]],
    ) -> tuple[int, torch.Tensor, float]:  # fmt: skip
        """The next result of a chunk the driver sent: (its id, its hidden state, when it was
        sent); a replayed chunk's result only rebuilt the caches and is passed over."""
        while True:
            chunk_id, h = await drafting.drafting_ahead(  # the draft model works while we wait
                run.decoder, self.compute, self._draft_limiter(run), lambda: self._next_result(chan, session)
            )
            entry = sent.pop(chunk_id, None)
            if entry is None:
                raise ProtocolError(f"tail {self._tail_peer}: result for unknown chunk {chunk_id}")
            if entry[0] is not None:
                return chunk_id, h, entry[1]

    async def _logits(self, run: RingRun, rows: torch.Tensor, session: int) -> torch.Tensor:
        """The LM head on a live chunk's rows (n_rows, D) -> (n_rows, V), batched across sessions."""
        if not rows.shape[0]:
            return torch.empty(0, self.args.vocab_size)
        try:
            logits, shared = await self.shared_head.logits(rows, session)
        except memory.OOM_ERRORS as exc:  # this request fails alone (node/compute/memory.py)
            memory.release(str(rows.device))
            raise RequestRefused(f"the coordinator's LM head: {memory.describe(exc)}") from None
        run.shared_head_calls += shared
        return logits

    def _draft_limiter(self, run: RingRun) -> trio.CapacityLimiter:
        """The limiter a drafter's work waits on in its worker thread: the draft model's, else ours."""
        return run.draft_limiter or self.compute.limiter

    async def _issue(self, run: RingRun, step: Send, session: int, sent: dict[int, tuple[VerifyChunk | None, float]]) -> None:
        """Send the driver's chunks, each as soon as it exists (a model drafter drafts off this
        loop, drafting.py); chunks sent again after a failed ring are just sent."""
        send = lambda c: self._send(c, session, sent, run)  # noqa: E731
        if step.resent:
            for chunk in step.chunks:
                await send(chunk)
            return
        dec = run.decoder
        if run.before_decode is not None and dec.stats.chunks and not dec.stats.decode_chunks:
            hook, run.before_decode = run.before_decode, None  # once: the prefill is out, no decode chunk yet
            hook(len(self._sessions) - 1)
        await drafting.issue(dec, step.chunks, send, self.compute, self._draft_limiter(run))

    async def _replay(self, run: RingRun, session: int, sent: dict[int, tuple[VerifyChunk | None, float]],
                      chan: trio.MemoryReceiveChannel[Message | SwarmError]) -> None:  # fmt: skip
        """Send the run's fed chunks again, at most the decoder's window of tokens in flight (as its
        prompt's pieces: module doc, prefill window); the results that come back meanwhile only
        rebuilt the caches (the last window's are passed over by ``_answer``)."""
        assert self._first is not None
        out: deque[int] = deque()  # tokens of each replay chunk sent whose result is not in
        for i, chunk in enumerate(run.fed_log):
            while out and sum(out) + len(chunk.tokens) > run.decoder.window_tokens:
                chunk_id, _ = await self._next_result(chan, session)
                if sent.pop(chunk_id, None) is None:
                    raise ProtocolError(f"tail {self._tail_peer}: result for unknown chunk {chunk_id}")
                out.popleft()
            out.append(len(chunk.tokens))
            ids = torch.tensor(chunk.tokens, dtype=torch.long)
            h = self.head.embed(ids)
            cid = REPLAY_ID_BASE + i
            sent[cid] = (None, time.perf_counter())
            msg = hidden_chunk(session, cid, chunk.base, "prefill", h, self.epoch)
            async with self._send_lock:
                await self._first.send_message(msg, timeout=SEND_TIMEOUT_S)

    async def _send(self, chunk: VerifyChunk, session: int, sent: dict[int, tuple[VerifyChunk | None, float]],
                    run: RingRun) -> None:  # fmt: skip
        assert self._first is not None
        ids = torch.tensor(chunk.tokens, dtype=torch.long)
        h = self.head.embed(ids)  # (T, D): a table lookup, cheaper than a thread hand-off
        mode = "prefill" if chunk.prefill else ("verify" if len(chunk.tokens) > 1 else "decode")
        msg = hidden_chunk(session, chunk.chunk_id, chunk.base, mode, h, self.epoch)
        sent[chunk.chunk_id] = (chunk, time.perf_counter())
        run.chunks.append((chunk.base, len(chunk.tokens)))
        async with self._send_lock:
            await self._first.send_message(msg, timeout=SEND_TIMEOUT_S)

    async def _receive(self, chan: trio.MemoryReceiveChannel[Message | SwarmError], session: int) -> Message | SwarmError:
        """The session's next result, waiting while the ring is busy (module doc: slow is not gone)."""
        start = trio.current_time()
        while True:
            with trio.move_on_after(self.chunk_timeout):
                return await chan.receive()
            now = trio.current_time()
            busy = now - self._last_result < self.chunk_timeout
            if not busy or now - start >= SLOW_WAIT_FACTOR * self.chunk_timeout:
                what = (
                    f"the ring is busy but sent nothing for this session within {now - start:.0f} s"
                    if busy else f"no result from the ring within {self.chunk_timeout:.0f} s"
                )
                raise PeerTimeout(
                    f"session {session}: {what} (first hop {self.first_hop}, tail {self._tail_peer})"
                )
            log.info("session %d: the ring is busy: still waiting for a result after %.0f s", session, now - start)

    async def _next_result(
        self, chan: trio.MemoryReceiveChannel[Message | SwarmError], session: int
    ) -> tuple[int, torch.Tensor]:
        msg = await self._receive(chan, session)
        if isinstance(msg, SwarmError):
            raise msg
        if isinstance(msg, Error):
            text = f"ring error on session {session} chunk {msg.chunk_id}: {msg.code}: {msg.message}"
            if msg.code in REQUEST_ERRORS:  # this request alone fails: the ring is sound, nobody is to blame
                raise REQUEST_ERRORS[msg.code](text)
            # an ERROR's "upstream=<id>" is a claim relayed by the ring, which any stage on
            # the way could forge: no blame here (the observing stage reports its upstream
            # to the leader itself, see authority.py); the run waits for the re-plan
            raise PeerError(text)
        if not isinstance(msg, Result) or msg.kind != "hidden":
            raise ProtocolError(f"tail {self._tail_peer}: expected RESULT(hidden), got {msg!r}")
        if msg.epoch != self.epoch:
            raise ProtocolError(f"tail {self._tail_peer}: result for epoch {msg.epoch}, serving {self.epoch}")
        try:
            h = read_hidden(msg, dim=self.args.dim, expect=self.dtype, peer=self._tail_peer)
        except ProtocolError as exc:
            raise FaultyPeer(self._tail_peer, str(exc)) from None
        return msg.chunk_id, h
