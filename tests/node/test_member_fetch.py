"""A block fetched from other members over /shard-swarm/tensors/1 (real libp2p hosts on loopback),
the rest from a real HTTP origin (nginx), every tensor checked; a lying member named and dropped."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm.errors import PeerError, PeerLost
from swarm.fetch.cache import ModelCache
from swarm.fetch.origin import FetchError, Origin
from swarm.fetch.peers import Holdings, Holds
from swarm.fetch.slices import local_path
from swarm.manifest.model_manifest import ModelManifest, manifest_of_path
from swarm.model.stage import Head, Stage
from swarm.model.weights import open_checkpoint
from swarm.net.host import SwarmHost, open_host
from swarm.node.compute.members import fetch_from_members, serve_tensors
from swarm.proto.admission import CLIENT, client_secret, member_key
from swarm.proto.limits import PROTO_TENSORS
from swarm.proto.messages import parse_message
from swarm.proto.tensors import RangeRefused, RangeRequest
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.origin_server import SKIP_REASON, have_nginx, origin_server

SECRET = hashlib.sha256(b"member fetch secret").digest()
SWARM = "0123456789abcdef0123456789abcdef"
LOOP = ("/ip4/127.0.0.1/tcp/0",)
SPEC = TinySpec(n_layers=6, dim=128, n_heads=4, n_kv_heads=2, intermediate_size=256, vocab_size=256)
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelManifest]:
    d = write_checkpoint(tmp_path_factory.mktemp("members") / "tiny", SPEC, shards=3)
    return d, manifest_of_path(d)


def _seed(i: int) -> bytes:
    return hashlib.sha256(b"member fetch seed %d" % i).digest()


@contextlib.asynccontextmanager
async def _members(n: int) -> AsyncIterator[list[SwarmHost]]:
    """``n`` member hosts; the first (the fetcher) connected and admitted to all the others."""
    async with contextlib.AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(_seed(i), LOOP, secret=SECRET, swarm_id=SWARM))
                 for i in range(n)]  # fmt: skip
        for h in hosts[1:]:
            await hosts[0].dial(h.addrs()[0])
        yield hosts


class Slow(Holdings):
    """A member's full copy holding only ``holds``; each read takes ``delay`` s and counts how many
    reads (of every Slow member) run at once; ``flip`` sends one byte of each read flipped."""

    now = 0
    most = 0

    def __init__(self, m: ModelManifest, base: Path, holds: Holds, delay: float = 0.0, flip: bool = False) -> None:
        super().__init__(m, base, holds.tensors, holds.files)
        self.delay, self.flip, self.reads = delay, flip, 0

    def read_into(self, path: str, offset: int, views: Sequence[memoryview], *, cached_only: bool = False) -> bool:
        if cached_only:  # a slow disk: nothing in the page cache, every read in a worker thread
            return False
        Slow.now += 1
        Slow.most = max(Slow.most, Slow.now)
        try:
            time.sleep(self.delay)
            super().read_into(path, offset, views)
        finally:
            Slow.now -= 1
        self.reads += 1
        if self.flip and path.endswith(".safetensors") and offset >= self.manifest.files[path].header_end:
            views[0][0] ^= 0x40
        return True


def _same(model: Path, cache: ModelCache, n_layers: int) -> None:
    ca, cb = open_checkpoint(model), open_checkpoint(local_path(cache))
    sa = Stage.load(ca.args, ca.source, 0, n_layers, dtype=torch.float32).state_dict()
    sb = Stage.load(cb.args, cb.source, 0, n_layers, dtype=torch.float32).state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ha = Head.load(ca.args, ca.source, dtype=torch.float32).state_dict()
    hb = Head.load(cb.args, cb.source, dtype=torch.float32).state_dict()
    assert all(torch.equal(ha[k], hb[k]) for k in ha)


def _everything(m: ModelManifest) -> tuple[list[Any], list[str]]:
    return m.block(0, m.n_layers) + m.head(), [f.path for f in m.files.values()]


@pytest.mark.skipif(not have_nginx(), reason=SKIP_REASON)
async def test_two_members_at_once_and_the_origin_for_the_rest(model: tuple[Path, ModelManifest], tmp_path: Path) -> None:
    d, m = model
    held = {1: Holds.of_layers(m, range(0, 3)), 2: Holds.of_layers(m, range(2, 6))}  # nobody holds the head
    async with _members(3) as (c, a, b):
        serving = {1: Slow(m, d, held[1], delay=0.02), 2: Slow(m, d, held[2], delay=0.02)}
        serve_tensors(a, lambda: serving[1])
        serve_tensors(b, lambda: serving[2])
        Slow.most = 0
        with origin_server(d, tmp_path / "nginx") as srv:
            cache = ModelCache(tmp_path / "cache", m)
            tensors, files = _everything(m)
            rep = await fetch_from_members(c, cache, tensors, files, {a.peer_id: held[1], b.peer_id: held[2]},
                                           [Origin(srv.url)])  # fmt: skip
            origin_bytes = srv.bytes_sent()
    assert not rep.liars and not rep.failed
    assert rep.by_source[a.peer_id] > 0 and rep.by_source[b.peer_id] > 0 and Slow.most >= 2  # at once
    head = sum(t.nbytes for t in m.head()) + sum(f.size for f in m.small_files() if f.path not in held[1].files)
    assert 0 < rep.by_source[srv.url] == origin_bytes <= head + 4096 * len(m.head())  # the origin sent no layer
    assert rep.origin_verify_s > 0  # the origin's part was hashed, and timed
    assert rep.fetched == sum(t.nbytes for t in tensors) + sum(f.header_end or f.size for f in m.files.values())
    assert cache.holds(tensors) and ModelCache(tmp_path / "cache", m).verified == cache.verified
    _same(d, cache, m.n_layers)


async def test_a_lying_member_is_named_and_its_pieces_come_from_another(model: tuple[Path, ModelManifest],
                                                                         tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    everything = Holds.of_layers(m, range(m.n_layers), head=True)
    liars: list[tuple[str, str]] = []
    async with _members(3) as (c, honest, liar):
        serve_tensors(honest, lambda: Slow(m, d, everything, delay=0.05))  # slow: the liar surely gets a piece
        lying = Slow(m, d, everything, flip=True)
        serve_tensors(liar, lambda: lying)
        cache = ModelCache(tmp_path / "cache", m)
        tensors, files = _everything(m)
        rep = await fetch_from_members(c, cache, tensors, files, {honest.peer_id: everything, liar.peer_id: everything},
                                       on_liar=lambda p, why: liars.append((p, why)))  # no origin  # fmt: skip
    assert lying.reads >= 1 and list(rep.liars) == [liar.peer_id] and [p for p, _ in liars] == [liar.peer_id]
    assert "failed sha256" in rep.liars[liar.peer_id] and not rep.failed
    assert set(rep.by_source) <= {honest.peer_id, liar.peer_id} and rep.by_source[honest.peer_id] > 0
    assert rep.paths[honest.peer_id] == {"libp2p": rep.by_source[honest.peer_id]}  # no fast path here
    assert cache.holds(tensors)
    _same(d, cache, m.n_layers)


async def test_a_member_that_goes_silent_is_dropped_after_its_deadline(model: tuple[Path, ModelManifest],
                                                                      tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    everything = Holds.of_layers(m, range(m.n_layers), head=True)
    async with _members(3) as (c, honest, frozen):
        serve_tensors(honest, lambda: Slow(m, d, everything, delay=0.02))

        async def silent(peer: str, fs: Any) -> None:  # takes the request, never answers
            await fs.receive(timeout=60)
            await trio.sleep(60)

        frozen.handle(PROTO_TENSORS, silent)
        cache = ModelCache(tmp_path / "cache", m)
        tensors, files = _everything(m)
        t0 = trio.current_time()
        rep = await fetch_from_members(c, cache, tensors, files, {honest.peer_id: everything, frozen.peer_id: everything},
                                       io_s=1.0)  # fmt: skip
        assert trio.current_time() - t0 < 20
    assert list(rep.failed) == [frozen.peer_id] and "PeerTimeout" in rep.failed[frozen.peer_id]
    assert set(rep.by_source) == {honest.peer_id} and cache.holds(tensors)


async def test_what_no_member_holds_without_an_origin_is_an_error_naming_it(model: tuple[Path, ModelManifest],
                                                                             tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    some = Holds.of_layers(m, range(0, 2))
    async with _members(2) as (c, a):
        serve_tensors(a, lambda: Slow(m, d, some))
        cache = ModelCache(tmp_path / "cache", m)
        with pytest.raises(FetchError, match="no member could serve .* no origin"):
            await fetch_from_members(c, cache, m.block(0, 4), [], {a.peer_id: some})
        assert {t.name for t in m.block(0, 2)} <= cache.verified  # what the member had is kept


async def test_refusals_are_typed_and_only_members_are_served(model: tuple[Path, ModelManifest]) -> None:
    d, m = model
    some = Holds.of_layers(m, [0])
    t_held = m.block(0, 1)[0]
    t_not = next(t for t in m.block(1, 2))
    async with _members(2) as (c, a):
        serve_tensors(a, lambda: Slow(m, d, some))
        async with c.open_stream(a.peer_id, PROTO_TENSORS) as fs:
            for i, (file, off, n, code) in enumerate([
                (t_not.file, t_not.start, t_not.nbytes, "not-held"),
                (t_held.file, t_held.start, 64 << 20, "too-large"),
                ("../secret", 0, 1, "unknown-file"),
            ], 1):  # fmt: skip
                await fs.send(RangeRequest(i, file, off, n).to_frame())
                msg = parse_message(await fs.receive(timeout=10))
                assert isinstance(msg, RangeRefused) and msg.req == i and msg.code == code, msg
            await fs.send(RangeRequest(9, t_held.file, t_held.start, t_held.nbytes).to_frame())
            got = b""
            while len(got) < t_held.nbytes:
                got += parse_message(await fs.receive(timeout=10)).data  # type: ignore[attr-defined]
            assert hashlib.sha256(got).hexdigest() == t_held.sha256
        async with open_host(_seed(9), LOOP, secret=client_secret(SECRET), swarm_id=SWARM, role=CLIENT,
                             member_key=member_key(SECRET)) as client:  # fmt: skip
            await client.dial(a.addrs()[0])
            with pytest.raises(PeerError):
                async with client.open_stream(a.peer_id, PROTO_TENSORS, timeout=5) as fs:
                    await fs.send(RangeRequest(1, t_held.file, t_held.start, 8).to_frame())
                    await fs.receive(timeout=5)


def _fetcher(fetch_dir: Path, model_dir: Path | None, origin: tuple[str, ...] = ()) -> Any:
    from types import SimpleNamespace

    from swarm.node.compute.fetching import BlockFetcher
    from swarm.node.compute.runtime import Compute
    from swarm.node.notices import Hooks, Notices

    settings = SimpleNamespace(fetch_dir=fetch_dir, model_dir=model_dir, origin=origin, disk_bytes=0)
    lives: list[dict[str, Any]] = []
    f = BlockFetcher(settings, Compute(), Notices(Hooks(on_life=lives.append)))  # type: ignore[arg-type]
    f.lives = lives
    return f


async def test_a_node_fetches_its_block_from_members_with_their_own_copies(model: tuple[Path, ModelManifest],
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """The node's own wiring (BlockFetcher): two members with their own copies of the model (one
    with a flipped byte in a layer-4 tensor) serve it, each tensor checked in place when first
    asked for; a third, with no origin, fetches its block and the head from them, never the bad
    tensor, and advertises what it then holds."""
    import shutil

    from swarm.node.members.membership import layer_ranges

    d, m = model
    bad_copy = tmp_path / "bad"
    shutil.copytree(d, bad_copy)
    flip = next(t for t in m.block(4, 5) if t.nbytes > 64)
    with open(bad_copy / flip.file, "r+b") as fh:
        fh.seek(flip.start + 7)
        b = fh.read(1)
        fh.seek(flip.start + 7)
        fh.write(bytes([b[0] ^ 1]))
    dirs = [ModelCache(tmp_path / f"c{i}", m).dir for i in range(3)]
    a, b, c = _fetcher(dirs[0], bad_copy), _fetcher(dirs[1], d), _fetcher(dirs[2], None)
    await a.block(0, 2)  # its own plan: checked in place as it loads
    assert a.held() == (list(range(m.n_layers)), True) and b.held() == a.held()  # a full copy serves it all
    said: list[tuple[list[int], bool]] = []
    async with _members(3) as (hc, ha, hb):
        serve_tensors(ha, a.holdings, widen=a.widen)
        serve_tensors(hb, b.holdings, widen=b.widen)

        def holders() -> dict[str, Holds]:  # as serving.py reads them from adverts
            out = {}
            for peer, f in ((ha.peer_id, a), (hb.peer_id, b)):
                layers, head = f.held()
                adv_layers = sorted(i for k, e in layer_ranges(layers).items() for i in range(int(k), e))
                out[peer] = Holds.of_layers(m, adv_layers, head=head)
            return out

        c.join_members(hc, holders, lambda layers, head: said.append((layers, head)))
        rep = await c.block(1, 6)
        assert set(rep.by_source) == {ha.peer_id, hb.peer_id} and rep.fetched >= m.block_bytes(1, 6)
        await c.head()
    assert not c.liars
    assert c.disk_left() is None  # no --disk
    c.cache.disk_budget = c.cache.held_bytes() + 5
    assert c.disk_left() == 5
    assert flip.name not in a._local_held[0]  # the flipped tensor was refused, never served
    assert not a.widen(flip.file, flip.start, flip.nbytes) and b.widen(flip.file, flip.start, flip.nbytes)
    assert not b.widen(flip.file, m.files[flip.file].size - 1, 5)  # past the last tensor: not the model's bytes
    assert b.widen("config.json", 0, 1) and "config.json" in b.holdings().spans  # a small file: checked whole
    assert not b.widen("config.json", 0, m.files["config.json"].size + 1) and not b.widen("nope.json", 0, 1)
    assert said[-1] == ([1, 2, 3, 4, 5], True) and c.cache.holds(m.block(1, 6) + m.head())
    assert [e["sources"] for e in c.lives if e.get("event") == "fetched"][0].keys() == {ha.peer_id, hb.peer_id}
    ca, cb = open_checkpoint(d), open_checkpoint(local_path(c.cache))
    sa = Stage.load(ca.args, ca.source, 1, 6, dtype=torch.float32).state_dict()
    sb = Stage.load(cb.args, cb.source, 1, 6, dtype=torch.float32).state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------- the fast path


@contextlib.asynccontextmanager
async def _fast(host: SwarmHost, served: Any, nursery: trio.Nursery) -> AsyncIterator[Any]:
    """``host``'s fast-path service with the node's own acceptor (wiring.py) in front of it:
    channels that open with a RANGE_REQUEST go to ``served`` (None: a node that does not serve
    ranges there), any other to the ring."""
    from types import SimpleNamespace

    from swarm.net.fastpath_host import open_fastpath_service
    from swarm.node.plan.wiring import Wiring

    async with open_fastpath_service(host) as fp:
        w = Wiring(host.peer_id, host, fp, None, None, None, nursery,  # type: ignore[arg-type]
                   report_fault=lambda *a: None, offered=lambda: 0, tensors=served)  # fmt: skip
        nursery.start_soon(w.accept_fast)
        yield SimpleNamespace(service=fp, dial=fp.dial)


def _dialer(fp: Any, paths: list[str]) -> Any:
    from swarm.node.ring.fastlink import FrameLink

    async def dial(peer: str, timeout: float) -> FrameLink:
        link = FrameLink(await fp.dial(peer, timeout=timeout))
        paths.append(link.path)
        return link

    return dial


def _count_streams(host: SwarmHost) -> list[str]:
    """Every PROTO_TENSORS stream ``host`` opens from now on."""
    opened: list[str] = []
    orig = host.open_stream

    def counting(peer: str, protocol: str, **kw: Any) -> Any:
        if protocol == PROTO_TENSORS:
            opened.append(peer)
        return orig(peer, protocol, **kw)

    host.open_stream = counting  # type: ignore[method-assign]
    return opened


async def test_members_fetch_over_the_fast_path_or_fall_back_to_libp2p(model: tuple[Path, ModelManifest],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """Three members serve everything: ``fast`` over a direct sealed socket; ``old`` runs the
    fast path but serves no ranges on it (it closes the channel at the first request); ``off``
    has no fast path at all. The fetcher gets every tensor, from ``fast`` over the direct socket
    only, from the other two over /shard-swarm/tensors/1, and drops nobody."""
    d, m = model
    everything = Holds.of_layers(m, range(m.n_layers), head=True)
    async with _members(4) as (c, fast, old, off), trio.open_nursery() as nursery:
        served = {h.peer_id: serve_tensors(h, lambda: Slow(m, d, everything, delay=0.01)) for h in (fast, old, off)}
        async with (_fast(c, None, nursery) as fc, _fast(fast, served[fast.peer_id], nursery) as ff,
                    _fast(old, None, nursery)):  # fmt: skip
            paths: list[str] = []
            opened = _count_streams(c)
            cache = ModelCache(tmp_path / "cache", m)
            tensors, files = _everything(m)
            rep = await fetch_from_members(c, cache, tensors, files, dict.fromkeys(served, everything),
                                           dial_fast=_dialer(fc, paths))  # fmt: skip
            assert ff.service.listener.accepted >= 1
        nursery.cancel_scope.cancel()
    assert not rep.failed and not rep.liars and set(rep.by_source) == set(served)
    # fast took one channel for both phases (the files, then the tensors: one dial a fetch); old
    # took one and, found out, was asked over libp2p for the rest of the fetch, as off (no fast
    # path) was from the start
    assert paths == ["direct"] * 2
    assert sorted(opened) == sorted([old.peer_id, off.peer_id] * 2)  # fast never fell back
    # the report says which path each member's bytes took
    assert rep.paths == {fast.peer_id: {"direct": rep.by_source[fast.peer_id]},
                         old.peer_id: {"libp2p": rep.by_source[old.peer_id]},
                         off.peer_id: {"libp2p": rep.by_source[off.peer_id]}}  # fmt: skip
    assert cache.holds(tensors)
    _same(d, cache, m.n_layers)


class _ClosedAfterHeaders:
    """A fast link its member closed once the headers' phase was done (idle past IDLE_S, say):
    the first request of the tensors' phase fails as it would on a closed channel."""

    def __init__(self, link: Any, m: ModelManifest) -> None:
        self.link, self.m = link, m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)

    async def send_message(self, msg: Any, **kw: Any) -> None:
        f = self.m.files[msg.file]
        if f.is_weights and msg.offset >= f.header_end:
            await self.link.close()
            raise PeerLost(f"peer {self.link.peer}: the fast channel is closed")
        await self.link.send_message(msg, **kw)


async def test_a_fast_link_closed_between_the_phases_is_dialled_again(model: tuple[Path, ModelManifest],
                                                                      tmp_path: Path) -> None:  # fmt: skip
    """The fetcher keeps a member's fast link from the headers' phase for the tensors'; one the
    member closed meanwhile is dialled again, not taken for a member without ranges on the fast
    path (which would send the rest over /shard-swarm/tensors/1)."""
    d, m = model
    everything = Holds.of_layers(m, range(m.n_layers), head=True)
    async with _members(2) as (c, fast), trio.open_nursery() as nursery:
        served = serve_tensors(fast, lambda: Slow(m, d, everything))
        async with _fast(c, None, nursery) as fc, _fast(fast, served, nursery):
            paths: list[str] = []
            opened = _count_streams(c)
            dial = _dialer(fc, paths)

            async def closed_once(peer: str, timeout: float) -> Any:
                link = await dial(peer, timeout)
                return _ClosedAfterHeaders(link, m) if len(paths) == 1 else link

            cache = ModelCache(tmp_path / "cache", m)
            tensors, files = _everything(m)
            rep = await fetch_from_members(c, cache, tensors, files, {fast.peer_id: everything},
                                           dial_fast=closed_once)  # fmt: skip
        nursery.cancel_scope.cancel()
    assert paths == ["direct"] * 2 and opened == []
    assert not rep.failed and rep.paths == {fast.peer_id: {"direct": rep.by_source[fast.peer_id]}}
    assert cache.holds(tensors)
    _same(d, cache, m.n_layers)


async def test_only_members_get_model_bytes_over_the_fast_path(model: tuple[Path, ModelManifest]) -> None:
    """A client (the client credential) cannot open a fast channel to a member (the door resets
    the stream), and the fast-channel server refuses a peer that is not a member even if one came
    through; a member's request on the same service is answered."""
    from swarm.errors import AdmissionError
    from swarm.node.ring.fastlink import FrameLink

    d, m = model
    some = Holds.of_layers(m, [0])
    t = m.block(0, 1)[0]
    async with _members(2) as (c, a), trio.open_nursery() as nursery:
        served = serve_tensors(a, lambda: Slow(m, d, some))
        async with (_fast(a, served, nursery), _fast(c, None, nursery) as fc,
                    open_host(_seed(9), LOOP, secret=client_secret(SECRET), swarm_id=SWARM, role=CLIENT,
                              member_key=member_key(SECRET)) as client, _fast(client, None, nursery) as fk):  # fmt: skip
            await client.dial(a.addrs()[0])
            with pytest.raises(PeerError):
                await fk.dial(a.peer_id, timeout=5)
            with pytest.raises(AdmissionError, match="not an admitted member"):
                await served(client.peer_id, None, RangeRequest(1, t.file, t.start, 8))
            link = FrameLink(await fc.dial(a.peer_id, timeout=5))
            assert link.path == "direct"
            await link.send(RangeRequest(2, t.file, t.start, 8).to_frame(), timeout=5)
            msg = parse_message(await link.receive(timeout=5))
            assert msg.req == 2 and msg.data == (d / t.file).read_bytes()[t.start : t.start + 8]  # type: ignore[attr-defined]
            await link.close()
        nursery.cancel_scope.cancel()


def test_a_data_head_fits_the_room_a_member_keeps_for_it() -> None:
    """The largest RANGE_DATA head (the largest offset, a whole chunk) fits HEAD_ROOM, so the
    member's frame buffers never write before their start."""
    from swarm.node.compute.members import HEAD_ROOM
    from swarm.proto.limits import DEFAULT_LIMITS
    from swarm.proto.tensors import MAX_OFFSET, RangeData

    n = DEFAULT_LIMITS.max_range_chunk
    assert len(RangeData.head((1 << 64) - 1, MAX_OFFSET - n, n, True, DEFAULT_LIMITS)) <= HEAD_ROOM
