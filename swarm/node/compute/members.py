"""The model's bytes from other members over /shard-swarm/tensors/1, and serving ours to them.

Serving (:func:`serve_tensors`): members only (the host's default roles: a client or an
unadmitted peer has its stream reset before a byte is read). Each request is checked against
what this node holds verified right now (``swarm.fetch.peers.Holdings``): a range outside it, over
``Limits.max_range_bytes``, or of a file the model does not have is answered with a typed
RANGE_REFUSED; a request past SERVE_SLOTS reads at once is refused "busy". Reads run in a worker
thread; every receive and send has a deadline.

Fetching (:func:`fetch_from_members`): first the files (weight headers, small files), then the
tensors, each phase an ``Assignment`` worked by one task per member that holds something
needed, all at once, each over its own stream, one request in flight per stream. Bytes land
through ``PieceSink`` (sha256 per tensor). A member whose bytes fail their hash is a liar: named
in a warning and to ``on_liar`` (the caller reports it), given no more pieces, and its pieces go
to the others; a member that times out or breaks the protocol stops being asked; one that
refuses a piece as not held or busy (its advert was older than its cache) keeps the others.
What no member could serve comes from the origins (``ModelCache.ensure``), or is a FetchError
naming it and every member dropped on the way.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from swarm.errors import PeerError, ProtocolError
from swarm.fetch.cache import ModelCache, Source
from swarm.fetch.origin import FetchError
from swarm.fetch.peers import (
    Assignment,
    Holdings,
    Holds,
    Piece,
    PieceSink,
    RangeRefused,
    file_pieces,
    tensor_pieces,
)
from swarm.manifest.model_manifest import TensorEntry
from swarm.node.hosting import Host, Stream
from swarm.proto.limits import PROTO_TENSORS, Limits
from swarm.proto.messages import parse_message
from swarm.proto.tensors import RangeReader, RangeRequest, data_frames
from swarm.proto.tensors import RangeRefused as Refused
from swarm.proto.text import printable

log = logging.getLogger("swarm.node.fetch")

IDLE_S = 30.0  # a serving stream with no request this long is closed
IO_S = 30.0  # one frame sent or received, either side
SERVE_SLOTS = 4  # ranges read from disk at once for other members


# ---------------------------------------------------------------------------- serving


def serve_tensors(host: Host, holdings: Callable[[], Holdings | None], *, io_s: float = IO_S,
                  widen: Callable[[str, int, int], bool] | None = None) -> None:  # fmt: skip
    """Answer byte-range requests from admitted members on PROTO_TENSORS. ``holdings()`` is what
    this node holds verified at the moment of each request (None: nothing). ``widen(file,
    offset, length)`` (a node with its own full copy) checks the tensors of a range not verified
    yet against the manifest, in a worker thread: True if they are now held."""
    limits = host.limits
    slots = trio.Semaphore(SERVE_SLOTS)

    async def check(h: Holdings | None, msg: RangeRequest) -> Holdings:
        if h is None:
            raise RangeRefused("not-held", "this member holds none of the model's files")
        try:
            h.check(msg.file, msg.offset, msg.length, limits.max_range_bytes)
            return h
        except RangeRefused as e:
            if e.code != "not-held" or widen is None:
                raise
        async with slots:
            if not await trio.to_thread.run_sync(widen, msg.file, msg.offset, msg.length):
                raise RangeRefused("not-held", f"{msg.file}: bytes [{msg.offset}, {msg.offset + msg.length}) "
                                   "are not tensors of this member's copy that match the manifest")  # fmt: skip
        h = holdings()
        assert h is not None
        h.check(msg.file, msg.offset, msg.length, limits.max_range_bytes)
        return h

    async def handler(peer: str, fs: Stream) -> None:
        while True:
            msg = parse_message(await fs.receive(timeout=IDLE_S), limits)
            if not isinstance(msg, RangeRequest):
                raise ProtocolError(f"{PROTO_TENSORS}: expected RANGE_REQUEST, got {type(msg).__name__}")
            try:
                h = await check(holdings(), msg)
                if slots.value == 0:
                    raise RangeRefused("busy", f"{SERVE_SLOTS} ranges are being read for other members: ask another")
                async with slots:
                    data = await trio.to_thread.run_sync(h.read, msg.file, msg.offset, msg.length)
            except RangeRefused as e:
                log.info("refused %s range request %s [%d, +%d): %s", peer, printable(msg.file)[:80],
                         msg.offset, msg.length, e.code)  # fmt: skip
                await fs.send(Refused(msg.req, e.code, str(e)[:256]).to_frame(), timeout=io_s)
                continue
            for d in data_frames(msg.req, msg.offset, data, limits):
                await fs.send(d.to_frame(), timeout=io_s)

    host.handle(PROTO_TENSORS, handler)  # members only: the host's default roles


# ---------------------------------------------------------------------------- fetching


@dataclass
class MembersReport:
    by_source: dict[str, int] = field(default_factory=dict)  # bytes landed: member peer ID or origin URL
    liars: dict[str, str] = field(default_factory=dict)  # member -> what it sent that failed its hash
    failed: dict[str, str] = field(default_factory=dict)  # member -> why it stopped being asked

    @property
    def fetched(self) -> int:
        return sum(self.by_source.values())


async def fetch_from_members(
    host: Host,
    cache: ModelCache,
    tensors: Sequence[TensorEntry],
    files: Collection[str],
    holders: Mapping[str, Holds],
    origins: Sequence[Source] = (),
    *,
    on_liar: Callable[[str, str], None] | None = None,
    io_s: float = IO_S,
) -> MembersReport:
    """Land ``tensors`` and ``files`` (plus the headers of the tensors' files) in ``cache``,
    asking the members in ``holders`` (what each says it holds) first, several at once, then
    ``origins`` for the rest. Everything is checked against the manifest before it is held."""
    m = cache.manifest
    want_files = sorted((set(files) | {t.file for t in tensors}) - cache.files)
    want = [t for t in tensors if t.name not in cache.verified]
    cache.check_budget(want, [m.files[p] for p in want_files])
    rep = MembersReport()
    usable = {p: h for p, h in holders.items() if p != host.peer_id}
    ids = itertools.count(1)
    for pieces in (file_pieces(m, want_files), tensor_pieces(want, host.limits.max_range_bytes)):
        if not pieces:
            continue
        a = Assignment(pieces, {p: h for p, h in usable.items() if p not in rep.failed and p not in rep.liars})
        for _ in range(len(usable) + 1):  # a piece given back goes to a member that already stopped
            if not any(a.candidates(p) for p in a.pending):
                break
            async with trio.open_nursery() as nursery:
                for peer in list(a.holders):
                    if a.usable(peer) and any(peer in a.candidates(p) for p in a.pending):
                        nursery.start_soon(_worker, host, cache, a, peer, ids, io_s)
        for peer, why in a.liars.items():
            if peer not in rep.liars:
                log.warning("member %s sent model bytes that are not the manifest's: %s; not asking it again", peer, why)
                if on_liar is not None:
                    on_liar(peer, why)
        rep.liars.update(a.liars)
        rep.failed.update(a.failed)
        for peer, n in a.by_peer.items():
            rep.by_source[peer] = rep.by_source.get(peer, 0) + n
        left = a.left_for_origin()
        if left:
            await _from_origin(cache, left, origins, rep)
    return rep


async def _from_origin(cache: ModelCache, left: list[Piece], origins: Sequence[Source], rep: MembersReport) -> None:
    if not origins:
        dropped = "; ".join(f"{p}: {printable(w)[:160]}" for p, w in {**rep.failed, **rep.liars}.items())
        raise FetchError(f"no member could serve {len(left)} pieces (first: {left[0]}) and there is no origin"
                         f"{f' (members dropped: {dropped})' if dropped else ''}")  # fmt: skip
    tensors = [t for p in left for t in p.tensors]
    files = [p.file for p in left if not p.tensors]
    r = await trio.to_thread.run_sync(lambda: cache.ensure(tensors, files, origins))
    for k, n in r.by_source.items():
        rep.by_source[k] = rep.by_source.get(k, 0) + n


async def _worker(host: Host, cache: ModelCache, a: Assignment, peer: str, ids: itertools.count[int],
                  io_s: float) -> None:  # fmt: skip
    piece: Piece | None = None
    try:
        async with host.open_stream(peer, PROTO_TENSORS, timeout=io_s) as fs:
            while (piece := a.take(peer)) is not None:
                try:
                    bad = await _fetch_piece(fs, cache, piece, ids, host.limits, io_s)
                except RangeRefused as e:
                    if e.code not in ("not-held", "busy"):
                        raise
                    a.give_back(piece, peer, str(e), drop=False)  # the stream is fine: go on with the rest
                    piece = None
                    continue
                if bad:
                    a.give_back(piece, peer, f"{piece.file}: {', '.join(bad[:3])} failed sha256", lied=True)
                else:
                    a.landed(piece, peer)
                piece = None
    except (PeerError, ProtocolError, FetchError) as e:  # a refusal other than not-held/busy included
        why = f"{type(e).__name__}: {e}"
        if piece is not None:
            a.give_back(piece, peer, why)
        else:
            a.failed.setdefault(peer, why)
        log.info("member %s stops serving this fetch: %s", peer, printable(why)[:300])


async def _fetch_piece(fs: Stream, cache: ModelCache, piece: Piece, ids: itertools.count[int],
                       limits: Limits, io_s: float) -> list[str]:  # fmt: skip
    sink = PieceSink(cache, piece)
    try:
        for a, b in piece.ranges(limits.max_range_bytes):
            req = RangeRequest(next(ids), piece.file, a, b - a)
            await fs.send(req.to_frame(), timeout=io_s)
            reader = RangeReader(req)
            while not reader.done:
                msg = parse_message(await fs.receive(timeout=io_s), limits)
                if isinstance(msg, Refused) and msg.req == req.req:
                    raise RangeRefused(msg.code, f"peer {fs.peer} refused {piece.file} [{a}, {b}): {msg.code}: "
                                                 f"{printable(msg.reason)[:200]}")  # fmt: skip
                data = reader.take(msg)
                await trio.to_thread.run_sync(sink.take, data)
        return sink.finish()
    finally:
        sink.close()
