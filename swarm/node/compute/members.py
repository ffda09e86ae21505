"""The model's bytes from other members over /shard-swarm/tensors/1, and serving ours to them.

Serving (:func:`serve_tensors`): members only (the host's default roles: a client or an
unadmitted peer has its stream reset before a byte is read). Each request is checked against
what this node holds verified right now (``swarm.fetch.peers.Holdings``): a range outside it, over
``Limits.max_range_bytes``, or of a file the model does not have is answered with a typed
RANGE_REFUSED; a request past SERVE_SLOTS disk reads at once is refused "busy". A frame's bytes
are read right before it is sealed and sent: from the page cache on the event loop (RWF_NOWAIT:
never a wait on the disk), else from the disk in a worker thread (READ_FRAMES at once, the kernel
reading the rest of the range ahead meanwhile); every receive and send has a deadline.

Fetching (:func:`fetch_from_members`): first the files (weight headers, small files), then the
tensors, each phase an ``Assignment`` worked by one task per member that holds something
needed, all at once, each over its own stream (a member's fast link serves both phases: one
dial a fetch, dialled again if the member closed it between them), several requests in flight
per stream and the bytes received landing in a worker thread while the next ones arrive
(rangepipe.py). Bytes land
through ``PieceSink`` (sha256 per tensor). A member whose bytes fail their hash is a liar: named
in a warning and to ``on_liar`` (the caller reports it), given no more pieces, and its pieces go
to the others; a member that times out or breaks the protocol stops being asked; one that
refuses a piece as not held or busy (its advert was older than its cache) keeps the others.
What no member could serve comes from the origins (``ModelCache.ensure``), or is a FetchError
naming it and every member dropped on the way.

The fast path (issue 25: py-libp2p streams cap at ~62 MB/s, a plain socket moves ~800). When
both ends run a fast-path service (swarm/net/fastpath_host.py, the ring's data plane), a worker
first dials a :class:`~swarm.net.direct.FastChannel` to its member and sends the same
RANGE_REQUESTs over it as whole frames (``FrameLink``, as the ring's hops do); the answers,
refusals, bounds, slots and deadlines are the same, served by the same code. No new channel kind
or tag: a fast channel's first message already says what it is for (a ring ``hop`` hello, a
``probe``, or now a RANGE_REQUEST: the node's fast-channel acceptor, wiring.py, hands that one to
:func:`serve_tensors`' handler). Members only, as on libp2p: the host's door resets a client's
or an unadmitted peer's fast-path stream, and the handler checks the member role again; the
dialer's service dials admitted peers only; a fast channel holds one of the peer's inbound
stream slots, as a stream does. A member without the service (fast path off, an older node)
fails the dial, or closes the channel at our first request without answering it: that piece
and the rest of this fetch then go over /shard-swarm/tensors/1, so the fast path never costs a
piece; a member that times out on the fast path is dropped as on libp2p, not asked again over
the slower path.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.errors import AdmissionError, PeerError, PeerTimeout, ProtocolError
from swarm.fetch.cache import ModelCache, Source
from swarm.fetch.origin import FetchError
from swarm.fetch.peers import (
    Assignment,
    Holdings,
    Holds,
    Piece,
    RangeRefused,
    file_pieces,
    tensor_pieces,
)
from swarm.manifest.model_manifest import TensorEntry
from swarm.node.compute.rangepipe import BufferPool, NoFastPath, fetch_pieces
from swarm.node.dispatch import role_of
from swarm.node.hosting import Host, Stream
from swarm.proto.admission import MEMBER
from swarm.proto.limits import PROTO_TENSORS, Limits
from swarm.proto.tensors import RangeData, RangeRequest
from swarm.proto.tensors import RangeRefused as Refused
from swarm.proto.text import printable

log = logging.getLogger("swarm.node.fetch")

IDLE_S = 30.0  # a serving stream with no request this long is closed
IO_S = 30.0  # one frame sent or received, either side
SERVE_SLOTS = 4  # ranges read from disk at once for other members
READ_FRAMES = 4  # RANGE_DATA frames read from the disk in one trip to a worker thread


# ---------------------------------------------------------------------------- serving


TensorServer = Callable[[str, Any, RangeRequest], Awaitable[None]]  # a fast channel's ranges
DialFast = Callable[[str, float], Awaitable[Any]]  # (peer, timeout) -> a fast-path frame link (send, receive, close)


def serve_tensors(host: Host, holdings: Callable[[], Holdings | None], *, io_s: float = IO_S,
                  widen: Callable[[str, int, int], bool] | None = None) -> TensorServer:  # fmt: skip
    """Answer byte-range requests from admitted members on PROTO_TENSORS. ``holdings()`` is what
    this node holds verified at the moment of each request (None: nothing). ``widen(file,
    offset, length)`` (a node with its own full copy) checks the tensors of a range not verified
    yet against the manifest, in a worker thread: True if they are now held.

    Returns the same service for a fast-path channel: ``await served(peer, link, first)`` with
    the channel's first message ``first`` (a RangeRequest) already read; it refuses (AdmissionError)
    a peer that is not an admitted member, and returns when the peer stops asking."""
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

    async def serve(peer: str, fs: Any, first: RangeRequest | None = None) -> None:
        msg: Any = first
        bufs = BufferPool(HEAD_ROOM + limits.max_range_chunk)  # a frame's head, then its payload
        while True:
            if msg is None:
                msg = await fs.receive_message(timeout=IDLE_S)
            if not isinstance(msg, RangeRequest):
                raise ProtocolError(f"{PROTO_TENSORS}: expected RANGE_REQUEST, got {type(msg).__name__}")
            try:
                h = await check(holdings(), msg)
                if slots.value == 0:
                    raise RangeRefused("busy", f"{SERVE_SLOTS} ranges are being read for other members: ask another")
                await _send_range(fs, h, msg, slots, bufs, limits, io_s)
            except RangeRefused as e:
                log.info("refused %s range request %s [%d, +%d): %s", peer, printable(msg.file)[:80],
                         msg.offset, msg.length, e.code)  # fmt: skip
                await fs.send_message(Refused(msg.req, e.code, str(e)[:256]), timeout=io_s)
            msg = None

    async def handler(peer: str, fs: Stream) -> None:
        await serve(peer, fs)

    async def served(peer: str, link: Any, first: RangeRequest) -> None:
        if role_of(host, peer, advertised=False) != MEMBER:
            raise AdmissionError(f"peer {peer} asked for model bytes over the fast path but is not an admitted member")
        try:
            await serve(peer, link, first)
        except PeerError as exc:  # the asker closed its channel, or went idle: as on libp2p
            log.debug("fast-path tensors channel from %s ended: %s", peer, exc)

    host.handle(PROTO_TENSORS, handler)  # members only: the host's default roles
    return served


HEAD_ROOM = 256  # room before a RANGE_DATA's payload for its head (under 80 bytes: header, dims, {"offset": n})


async def _send_range(fs: Any, h: Holdings, msg: RangeRequest, slots: trio.Semaphore, bufs: BufferPool,
                      limits: Limits, io_s: float) -> None:  # fmt: skip
    """The range as RANGE_DATA frames of ``limits.max_range_chunk`` bytes, each read straight into
    a pooled buffer after HEAD_ROOM bytes for its head. A frame whose bytes are in the page cache
    is read right here, just before it is sealed and sent (no worker-thread trip, its bytes still
    in the CPU's cache when sealed and sent: py-spy and perf on bench_fetch_members.py); one that
    is not is read from the disk with the next READ_FRAMES - 1 in one worker thread trip, which
    also asks the kernel to read the rest of the range ahead (the sends go on meanwhile). A fast
    channel's frame link (``send_encoded``) is handed each frame as it lies in its buffer; a
    libp2p stream encodes it (one copy)."""
    end, step = msg.offset + msg.length, limits.max_range_chunk
    raw = getattr(fs, "send_encoded", None)
    ahead: collections.deque[tuple[int, memoryview, bytearray]] = collections.deque()  # read, not sent
    at = msg.offset
    try:
        while at < end or ahead:
            if not ahead:
                buf = bufs.take()
                view = memoryview(buf)[HEAD_ROOM : HEAD_ROOM + min(step, end - at)]
                if h.read_into(msg.file, at, [view], cached_only=True):
                    ahead.append((at, view, buf))
                else:
                    n = min(step * READ_FRAMES, end - at)
                    frames = [(at + i, buf if i == 0 else bufs.take(), min(step, n - i)) for i in range(0, n, step)]
                    ahead.extend((off, memoryview(b)[HEAD_ROOM : HEAD_ROOM + k], b) for off, b, k in frames)
                    async with slots:
                        await trio.to_thread.run_sync(h.read_ahead, msg.file, at, [v for _, v, _ in ahead], end)
                at += sum(len(v) for _, v, _ in ahead)
            off, data, buf = ahead.popleft()
            last = off + len(data) >= end
            if raw is None:
                await fs.send_message(RangeData.of(msg.req, off, data, last), timeout=io_s)
            else:
                head = RangeData.head(msg.req, off, len(data), last, limits)
                start = HEAD_ROOM - len(head)
                buf[start:HEAD_ROOM] = head
                await raw(memoryview(buf)[start : HEAD_ROOM + len(data)], timeout=io_s)
            bufs.give_back(buf)  # sent, sealed or encoded: free again (READ_FRAMES at most taken)
    finally:
        for _, _, buf in ahead:
            bufs.give_back(buf)


# ---------------------------------------------------------------------------- fetching


@dataclass
class MembersReport:
    by_source: dict[str, int] = field(default_factory=dict)  # bytes landed: member peer ID or origin URL
    liars: dict[str, str] = field(default_factory=dict)  # member -> what it sent that failed its hash
    failed: dict[str, str] = field(default_factory=dict)  # member -> why it stopped being asked
    # bytes landed from each member by the path they took: "direct" (the fast path's sealed
    # socket), "fast-libp2p" (a fast channel carried over its libp2p stream: no direct socket),
    # "libp2p" (/shard-swarm/tensors/1)
    paths: dict[str, dict[str, int]] = field(default_factory=dict)
    origin_verify_s: float = 0.0  # seconds hashing what landed from the origins (members' not timed)

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
    dial_fast: DialFast | None = None,
) -> MembersReport:
    """Land ``tensors`` and ``files`` (plus the headers of the tensors' files) in ``cache``,
    asking the members in ``holders`` (what each says it holds) first, several at once, then
    ``origins`` for the rest. Everything is checked against the manifest before it is held.
    ``dial_fast(peer, timeout)`` (a fast-path channel as a frame link, or None: libp2p only)
    carries the requests where the member serves them there (see the module's docstring)."""
    m = cache.manifest
    want_files = sorted((set(files) | {t.file for t in tensors}) - cache.files)
    want = [t for t in tensors if t.name not in cache.verified]
    cache.check_budget(want, [m.files[p] for p in want_files])
    rep = MembersReport()
    usable = {p: h for p, h in holders.items() if p != host.peer_id}
    ids = itertools.count(1)
    slow: set[str] = set()  # members found without ranges on the fast path: libp2p for the rest of this fetch
    links: dict[str, Any] = {}  # fast links that served a phase whole, for the next (one dial per member)
    try:
        await _phases(host, cache, m, want_files, want, origins, usable, ids, slow, links, rep, on_liar, io_s, dial_fast)
    finally:
        with trio.CancelScope(shield=True):
            for peer in list(links):
                await _drop(links, peer)
    return rep


async def _phases(host: Host, cache: ModelCache, m: Any, want_files: list[str], want: list[TensorEntry],
                  origins: Sequence[Source], usable: dict[str, Holds], ids: itertools.count[int], slow: set[str],
                  links: dict[str, Any], rep: MembersReport, on_liar: Callable[[str, str], None] | None, io_s: float,
                  dial_fast: DialFast | None) -> None:  # fmt: skip
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
                        nursery.start_soon(_worker, host, None if peer in slow else dial_fast, cache, a, peer, ids, io_s,
                                           slow, rep.paths, links)  # fmt: skip
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
    rep.origin_verify_s += r.verify_s or 0.0


async def _worker(host: Host, dial_fast: DialFast | None, cache: ModelCache, a: Assignment, peer: str,
                  ids: itertools.count[int], io_s: float, slow: set[str], paths: dict[str, dict[str, int]],
                  links: dict[str, Any]) -> None:  # fmt: skip
    first: list[Piece] = []  # taken for the fast channel, which turned out to serve no ranges
    path, before = "libp2p", a.by_peer.get(peer, 0)  # this worker alone lands ``peer``'s pieces
    try:
        while dial_fast is not None:
            link, reused = links.get(peer), True
            if link is None:
                link, reused = await _dial(dial_fast, peer, io_s), False
                if link is None:
                    slow.add(peer)
                    break
                links[peer] = link
            path = "direct" if getattr(link, "path", "") == "direct" else "fast-libp2p"
            try:
                first, taken = [], first
                await fetch_pieces(link, cache, a, peer, ids, host.limits, io_s, first=taken, unproven=True)
                return  # the link stays open for the next phase
            except NoFastPath as e:
                first = e.pieces
                await _drop(links, peer)
                if not reused:
                    slow.add(peer)
                    break
                # else the member closed our link between phases (idle): dial it again
            except BaseException:
                await _drop(links, peer)
                raise
        path = "libp2p"
        async with host.open_stream(peer, PROTO_TENSORS, timeout=io_s) as fs:
            first, taken = [], first
            await fetch_pieces(fs, cache, a, peer, ids, host.limits, io_s, first=taken)
    except (PeerError, ProtocolError, FetchError) as e:  # a refusal other than not-held/busy included
        why = f"{type(e).__name__}: {e}"
        for piece in first:  # the libp2p stream did not open
            a.give_back(piece, peer, why)
        a.failed.setdefault(peer, why)
        log.info("member %s stops serving this fetch: %s", peer, printable(why)[:300])
    finally:
        if (n := a.by_peer.get(peer, 0) - before) > 0:
            by = paths.setdefault(peer, {})
            by[path] = by.get(path, 0) + n


async def _dial(dial_fast: DialFast, peer: str, io_s: float) -> Any:
    """A fast-path channel to ``peer`` as a frame link, or None (no service here, or the member
    answers none: its protocol refused or unsupported). A dial that times out is the member's
    failure, as on libp2p."""
    try:
        return await dial_fast(peer, io_s)
    except PeerTimeout:
        raise
    except (PeerError, ProtocolError) as e:
        log.info("no fast path to member %s (%s): fetching over %s", peer, printable(str(e))[:200], PROTO_TENSORS)
        return None


async def _drop(links: dict[str, Any], peer: str) -> None:
    link = links.pop(peer, None)
    if link is not None:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            await link.close()
