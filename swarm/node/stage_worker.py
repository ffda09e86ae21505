"""One stage of the ring: verify chunks in from upstream, through its layer block, out downstream.

Theory of operation
-------------------
A stage worker owns one ``Stage`` (layers [start, end)) for one plan epoch and two links: the
inbound one from the previous hop and the outbound one to the next (the tail's next hop is the
coordinator). Frames are handled strictly in arrival order, which is the coordinator's send order
because every hop is FIFO; that is what makes speculative rollback simple:

- CHUNK (session, chunk id, base position ``pos``, T hidden states): the session's cache is first
  truncated to ``pos`` (this drops tokens the coordinator rejected after the previous chunk was
  sent), then the block runs, and the result goes downstream with the same header. A stage that
  holds fewer than ``pos`` positions cannot run the chunk (its context is missing): it reports an
  ERROR downstream instead. The first chunk of a session (``pos == 0``) opens its cache.
- SESSION_END frees the session's cache and travels on; ERROR and ROLLBACK travel on too, so
  whatever a stage reports reaches the coordinator through the tail.

The tail sends RESULT(kind="hidden") frames: the coordinator holds the final norm and LM head, and
D hidden values per token are far smaller than V logits. Torch work runs in a worker thread behind
one limiter per process, so the trio loop keeps pumping every stream while a block computes.

Bad input from the upstream peer (a malformed frame, a NaN activation, a wrong shape or epoch)
never reaches the model: the chunk is answered with an ERROR naming the peer and the field, and
the worker keeps serving the other sessions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from swarm.errors import PeerLost, PeerTimeout, ProtocolError, SwarmError
from swarm.model.stage import Stage
from swarm.node.links import Link
from swarm.node.wire import decode_hidden, encode_hidden
from swarm.proto.frame import Frame, MsgType
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import Chunk, Error, Result, Rollback, SessionEnd, parse_message

log = logging.getLogger("swarm.node.stage")

INLINE_MAX_TOKENS = 16  # chunks this small run on the trio thread when they are quick...
INLINE_MAX_S = 0.05  # ...taking under this long (else a worker thread keeps the loop responsive)
IDLE_POLL_S = 5.0  # an idle inbound link is fine; we only wake to notice cancellation
SEND_TIMEOUT_S = 10.0


@dataclass
class StageStats:
    chunks: int = 0
    tokens: int = 0
    errors: int = 0
    compute_s: float = 0.0


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
        limiter: trio.CapacityLimiter | None = None,
        limits: Limits = DEFAULT_LIMITS,
        on_bad_input: Callable[[str, str], None] | None = None,
    ) -> None:
        self.stage = stage
        self.epoch = epoch
        self.upstream = upstream
        self.is_tail = is_tail
        self.max_sessions = max_sessions
        self.max_len = max_len or stage.args.max_seq_len
        self.limiter = limiter or trio.CapacityLimiter(1)
        self.limits = limits
        # bad activations are reported to the leader by us, the receiving end of the hop: an
        # in-band ERROR naming a peer is only a claim that any stage on the way could forge
        self.on_bad_input = on_bad_input
        self._reported = False
        self.dtype = next(stage.parameters()).dtype
        self.stats = StageStats()
        self._fwd_s = 0.0  # moving average of a small chunk's forward time
        self.corrupt_after: int | None = None  # fault injection for chaos tests: NaN after N chunks

    def __repr__(self) -> str:
        return f"StageWorker([{self.stage.start}, {self.stage.end}), epoch={self.epoch})"

    async def serve(self, inbound: Link, outbound: Link) -> None:
        """Run until the inbound link closes (PeerLost) or the caller cancels."""
        try:
            while True:
                try:
                    frame = await inbound.receive(timeout=IDLE_POLL_S)
                except PeerTimeout:
                    continue
                await self._handle(frame, outbound)
        except PeerLost:
            log.info("%r: upstream %s closed", self, self.upstream)
        finally:
            for session in list(self.stage.sessions()):
                self.stage.close_session(session)

    async def _handle(self, frame: Frame, outbound: Link) -> None:
        try:
            msg = parse_message(frame, self.limits)
        except ProtocolError as exc:
            self.stats.errors += 1
            log.warning("%r: bad frame from %s: %s", self, self.upstream, exc)
            await self._report(outbound, frame.session, frame.seq, "bad_frame", str(exc))
            return
        if isinstance(msg, Chunk):
            await self._chunk(msg, outbound)
        elif isinstance(msg, SessionEnd):
            if msg.session in self.stage.sessions():
                self.stage.close_session(msg.session)
            if not self.is_tail:
                await outbound.send(frame, timeout=SEND_TIMEOUT_S)
        elif isinstance(msg, Rollback):
            if msg.session in self.stage.sessions() and self.stage.session_len(msg.session) > msg.length:
                self.stage.rollback(msg.session, msg.length)
            if not self.is_tail:
                await outbound.send(frame, timeout=SEND_TIMEOUT_S)
        elif isinstance(msg, Error):
            await outbound.send(frame, timeout=SEND_TIMEOUT_S)
        else:
            await self._report(
                outbound, frame.session, frame.seq, "unexpected", f"{MsgType(frame.msg_type).name} on the activation path"
            )

    async def _chunk(self, msg: Chunk, outbound: Link) -> None:
        where = f"stage [{self.stage.start}, {self.stage.end})"
        try:
            if msg.epoch != self.epoch:
                raise ProtocolError(f"chunk for epoch {msg.epoch}, {where} serves epoch {self.epoch}")
            h = decode_hidden(
                msg.dtype, msg.shape, msg.data, dim=self.stage.args.dim, expect=self.dtype, peer=self.upstream
            )
        except SwarmError as exc:  # the upstream peer sent bad activations: name it as faulty
            self.stats.errors += 1
            log.warning("%r: bad activations from %s: %s", self, self.upstream, exc)
            await self._report(outbound, msg.session, msg.chunk_id, "bad_input", f"upstream={self.upstream} {exc}")
            if self.on_bad_input is not None and not self._reported:  # once: the leader re-plans
                self._reported = True
                self.on_bad_input(self.upstream, str(exc))
            return
        try:
            self._prepare_cache(msg, where)
        except SwarmError as exc:
            self.stats.errors += 1
            log.warning("%r: refused chunk %d of session %d: %s", self, msg.chunk_id, msg.session, exc)
            await self._report(outbound, msg.session, msg.chunk_id, "bad_chunk", str(exc))
            return
        t0 = time.perf_counter()
        if msg.tokens <= INLINE_MAX_TOKENS and self._fwd_s < INLINE_MAX_S:
            # a decode/verify step that takes a few ms: two thread hand-offs would cost about as
            # much (measured: 3-6 ms of overhead per stage per token); the loop stalls briefly
            out = self.stage.forward(msg.session, h)
        else:
            out = await trio.to_thread.run_sync(self.stage.forward, msg.session, h, limiter=self.limiter)
        took = time.perf_counter() - t0
        if msg.tokens <= INLINE_MAX_TOKENS:
            self._fwd_s = took if self._fwd_s == 0.0 else 0.8 * self._fwd_s + 0.2 * took
        if self.corrupt_after is not None and self.stats.chunks >= self.corrupt_after:
            out = torch.full_like(out, float("nan"))  # fault injection (chaos tests): a broken peer
        self.stats.compute_s += took
        self.stats.chunks += 1
        self.stats.tokens += msg.tokens
        dt, shape, data = encode_hidden(out)
        reply: Chunk | Result
        if self.is_tail:
            reply = Result(msg.session, msg.chunk_id, msg.pos, "hidden", dt, shape, data, msg.epoch)
        else:
            reply = Chunk(msg.session, msg.chunk_id, msg.pos, msg.mode, dt, shape, data, msg.epoch, msg.flags)
        await outbound.send(reply.to_frame(), timeout=SEND_TIMEOUT_S)

    def _prepare_cache(self, msg: Chunk, where: str) -> None:
        session = msg.session
        if session not in self.stage.sessions():
            if msg.pos != 0:
                raise ProtocolError(f"{where}: session {session} unknown and chunk starts at {msg.pos}")
            if len(self.stage.sessions()) >= self.max_sessions:
                raise ProtocolError(f"{where}: {self.max_sessions} sessions open (limit max_sessions)")
            self.stage.open_session(session, self.max_len)
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
            await outbound.send(Error(session, chunk_id, code, text[:1000]).to_frame(), timeout=SEND_TIMEOUT_S)
        except SwarmError as exc:
            log.warning("%r: could not report error downstream: %s", self, exc)
