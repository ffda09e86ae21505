"""One member's pieces over one stream (or fast channel), several range requests in flight.

Theory of operation
-------------------
A member answers the requests of one stream in order, each range as RANGE_DATA frames ending with
one flagged LAST (swarm/proto/tensors.py). So the asker need not wait for a range's last byte
before asking the next: :func:`fetch_pieces` keeps up to ``DEPTH`` requests in flight, and the
member finds the next request already queued when it finishes one (with one in flight, every
16 MiB range cost a round trip, the member's first read and the asker's landing of the piece:
the link idled between ranges). Answers are matched to the oldest request in flight
(``RangeReader`` checks each frame is exactly its next bytes; anything else is a ProtocolError).

Bytes land (``PieceSink``: pwrite, sha256 per tensor) in a worker thread, in arrival order, behind
a queue of ``WRITE_AHEAD`` frames, while the next frames are received and opened; a piece's
verdict (landed, or a liar's bytes) is settled on the event loop after its last byte landed.

What is taken and not settled is never lost: a refusal "not-held"/"busy" gives that piece back
(its answers still due are read and dropped) and the stream goes on; any other failure gives back
every piece in flight. A fast channel that closes before its first answer (a member that serves
no ranges there) raises :class:`NoFastPath` carrying the pieces taken, for the caller to ask
again over /shard-swarm/tensors/1.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.errors import PeerError, PeerLost, ProtocolError
from swarm.fetch.cache import ModelCache
from swarm.fetch.origin import FetchError
from swarm.fetch.peers import Assignment, Piece, PieceSink, RangeRefused
from swarm.proto.limits import Limits
from swarm.proto.tensors import RangeReader, RangeRequest
from swarm.proto.tensors import RangeRefused as Refused
from swarm.proto.text import printable

log = logging.getLogger("swarm.node.fetch")

DEPTH = 3  # range requests in flight per stream
WRITE_AHEAD = 4  # RANGE_DATA frames received and not landed yet, per stream (1 MiB each)
FRAME_SLACK = 4096  # a RANGE_DATA frame's header and metadata, over its payload


class NoFastPath(Exception):
    """The member took the fast channel but closed it before answering anything (it does not
    serve ranges there): ``pieces`` (those taken for it) go over libp2p instead."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__(f"{len(pieces)} pieces for the libp2p stream")
        self.pieces = list(pieces)


@dataclass(eq=False)
class _Taken:
    """A piece taken for this stream: where its bytes land, its ranges not yet asked, how many
    of its requests are in flight; ``dropped`` once refused (its answers are read, not kept)."""

    piece: Piece
    sink: PieceSink
    todo: collections.deque[tuple[int, int]]
    asked: int = 0
    dropped: bool = False


@dataclass
class _Pipe:
    fs: Any
    cache: ModelCache
    a: Assignment
    peer: str
    ids: itertools.count[int]
    limits: Limits
    first: collections.deque[Piece]
    unproven: bool  # a fast channel that has answered nothing yet
    taken: list[_Taken] = field(default_factory=list)  # in the order taken, not settled yet
    sinks: list[PieceSink] = field(default_factory=list)  # every one opened (closed at the end)
    inflight: collections.deque[tuple[RangeReader, _Taken]] = field(default_factory=collections.deque)

    def next_request(self) -> tuple[RangeRequest, _Taken] | None:
        """The last piece's next range, else the first range of a new piece (None: no more)."""
        cur = self.taken[-1] if self.taken and self.taken[-1].todo else None
        if cur is None:
            piece = self.first.popleft() if self.first else self.a.take(self.peer)
            if piece is None:
                return None
            sink = PieceSink(self.cache, piece)
            self.sinks.append(sink)
            cur = _Taken(piece, sink, collections.deque(piece.ranges(self.limits.max_range_bytes)))
            self.taken.append(cur)
        s, e = cur.todo.popleft()
        cur.asked += 1
        return RangeRequest(next(self.ids), cur.piece.file, s, e - s), cur

    def settle(self, t: _Taken, bad: list[str]) -> None:
        self.taken.remove(t)
        if bad:
            self.a.give_back(t.piece, self.peer, f"{t.piece.file}: {', '.join(bad[:3])} failed sha256", lied=True)
        else:
            self.a.landed(t.piece, self.peer)

    def refused(self, t: _Taken, e: RangeRefused) -> None:
        """The member refused one of ``t``'s ranges as not held or busy: ``t`` goes back."""
        t.dropped = True
        t.todo.clear()
        self.taken.remove(t)
        self.a.give_back(t.piece, self.peer, str(e), drop=False)


# run in a thread, then (result) on the loop; the receive buffer its bytes are in, free once it ran
Job = tuple[Callable[[], Any], Callable[[Any], None] | None, bytearray | None]


class BufferPool:
    """One stream's reused frame buffers, all ``size`` bytes: a buffer is taken for one message
    and given back once that message is done with (landed, dropped or sent), so a stream of MiB
    frames touches no fresh pages (py-spy and perf on bench_fetch_members.py: a fresh MiB and its
    copy cost more than the AEAD). Never shared between streams."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[bytearray] = []

    def take(self) -> bytearray:
        return self.free.pop() if self.free else bytearray(self.size)

    def give_back(self, buf: bytearray | None) -> None:
        if buf is not None:
            self.free.append(buf)


class _Buffers(BufferPool):
    """The receive side: a fast channel's frame link (``opens_into``) opens each RANGE_DATA
    message straight into a pooled buffer (no copy of each MiB); at most 2 * WRITE_AHEAD + 1 are
    taken at once (one receiving, a queue, a batch landing). A libp2p stream gives each message
    its own copy (no buffer)."""

    def __init__(self, fs: Any, size: int) -> None:
        super().__init__(size)
        self.fs = fs
        self.opens_into = bool(getattr(fs, "opens_into", False))

    async def next(self, timeout: float) -> tuple[Any, bytearray | None]:
        """The next message (a payload a view, where the link gives one), and the buffer it lies
        in (None: a copy of its own)."""
        buf = self.take() if self.opens_into else None
        return await self.fs.receive_message(timeout=timeout, view=True, into=buf), buf


async def _pump(p: _Pipe, bufs: _Buffers, send: trio.MemorySendChannel[Job],
                io_s: float) -> PeerError | ProtocolError | FetchError | None:  # fmt: skip
    """Ask and receive until nothing is left (None), or the stream broke or the member refused
    for good: that error, returned, so that what is queued still lands before it is raised."""
    fs = p.fs
    try:
        while True:
            while len(p.inflight) < DEPTH and (nr := p.next_request()) is not None:
                req, t = nr
                await fs.send_message(req, timeout=io_s)
                p.inflight.append((RangeReader(req), t))
            if not p.inflight:
                return None
            reader, t = p.inflight[0]
            msg, buf = await bufs.next(io_s)
            p.unproven = False
            if isinstance(msg, Refused) and msg.req == reader.req.req:
                p.inflight.popleft()
                t.asked -= 1
                r = reader.req
                e = RangeRefused(msg.code, f"peer {fs.peer} refused {r.file} [{r.offset}, {r.offset + r.length}): "
                                           f"{msg.code}: {printable(msg.reason)[:200]}")  # fmt: skip
                bufs.give_back(buf)
                if msg.code not in ("not-held", "busy"):
                    return e
                if not t.dropped:
                    p.refused(t, e)
                    await send.send((t.sink.close, None, None))
                continue
            data = reader.take(msg)
            if t.dropped:
                bufs.give_back(buf)
            else:
                await send.send((functools.partial(t.sink.take, data), None, buf))
            if reader.done:
                p.inflight.popleft()
                t.asked -= 1
                if not t.dropped and not t.todo and not t.asked:
                    await send.send((t.sink.finish, functools.partial(p.settle, t), None))
    except (PeerError, ProtocolError, FetchError) as e:
        return e


def _run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    return [fn() for fn in fns]


async def fetch_pieces(fs: Any, cache: ModelCache, a: Assignment, peer: str, ids: itertools.count[int],
                       limits: Limits, io_s: float, *, first: Sequence[Piece] = (), unproven: bool = False) -> None:  # fmt: skip
    """Fetch pieces from ``peer`` over ``fs`` (a stream or frame link) until none is left for it:
    ``first`` (already taken from ``a``), then what ``a`` hands out. ``unproven``: a fast
    channel that has answered nothing yet (a close now is :class:`NoFastPath`). Raises what
    broke the stream (PeerError, ProtocolError, a refusal other than not-held/busy) after the
    pieces that arrived whole have landed; every piece taken and not landed goes back to ``a``."""
    p = _Pipe(fs, cache, a, peer, ids, limits, collections.deque(first), unproven)
    bufs = _Buffers(fs, limits.max_range_chunk + FRAME_SLACK)
    send, recv = trio.open_memory_channel[Job](WRITE_AHEAD)

    async def writer() -> None:  # what is queued lands in one trip to the thread
        async with recv:
            async for job in recv:
                jobs = [job]
                while len(jobs) < WRITE_AHEAD:
                    try:
                        jobs.append(recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                got = await trio.to_thread.run_sync(_run_all, [fn for fn, _, _ in jobs])
                for (_, then, buf), r in zip(jobs, got, strict=True):
                    bufs.give_back(buf)
                    if then is not None:
                        then(r)

    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                async with send:  # closed on the way out: the writer lands what is queued, then ends
                    broke = await _pump(p, bufs, send, io_s)
            if broke is not None:  # raised only now: what fully arrived before it has landed
                raise broke
        except BaseExceptionGroup as group:  # the caller's own exception, not a group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    except BaseException as e:
        if p.unproven and isinstance(e, (PeerLost, ProtocolError)):
            log.info("member %s closed the fast channel before answering (%s): fetching over libp2p",
                     peer, printable(str(e))[:200])  # fmt: skip
            raise NoFastPath([t.piece for t in p.taken] + list(p.first)) from None
        for t in p.taken:
            a.give_back(t.piece, peer, "stopped before it landed", drop=False)
        for piece in p.first:
            a.give_back(piece, peer, "stopped before it was asked", drop=False)
        raise
    finally:
        for sink in p.sinks:
            sink.close()
        # what landed since the last save (PieceSink saves at most every SAVE_EVERY_S), written off
        # the event loop, cancelled or not
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(cache.save)
