"""One member's pieces over one stream with several requests in flight (rangepipe.py), against a
scripted member: no sockets, so what is in flight when is exact, not a timing."""

from __future__ import annotations

import collections
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from swarm.errors import PeerLost
from swarm.fetch.cache import ModelCache
from swarm.fetch.peers import Assignment, Holds, Piece, PieceSink, file_pieces, tensor_pieces
from swarm.manifest.model_manifest import ModelManifest, manifest_of_path
from swarm.node.compute.rangepipe import DEPTH, WRITE_AHEAD, NoFastPath, fetch_pieces
from swarm.proto.frame import Frame, decode_frame, encode_frame
from swarm.proto.limits import Limits
from swarm.proto.messages import MessageIO, parse_message
from swarm.proto.tensors import RangeRefused, RangeRequest, data_frames
from swarm.testing.checkpoints import TinySpec, write_checkpoint

SPEC = TinySpec(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, intermediate_size=128, vocab_size=128)
LIMITS = Limits(max_range_bytes=8192, max_range_chunk=1024)  # many ranges, several frames each


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelManifest]:
    d = write_checkpoint(tmp_path_factory.mktemp("pipe") / "tiny", SPEC, shards=2)
    return d, manifest_of_path(d)


class Member(MessageIO):
    """Answers each request when the asker next waits for an answer (so the asker sends all it
    will before anything comes back): the file's bytes in RANGE_DATA frames. ``cut_after``:
    the stream breaks after that many frames; ``refuse``: request numbers answered "busy";
    ``flip``: request numbers whose first byte is flipped; ``closed``: a fast channel that
    serves no ranges (closed at once)."""

    def __init__(self, base: Path, *, cut_after: int | None = None, refuse: set[int] = frozenset(),  # type: ignore[assignment]
                 flip: set[int] = frozenset(), closed: bool = False, peer: str = "m") -> None:  # type: ignore[assignment]  # fmt: skip
        self.base, self.cut_after, self.refuse, self.flip, self.closed = base, cut_after, refuse, flip, closed
        self.peer, self.limits = peer, LIMITS
        self.asked: collections.deque[RangeRequest] = collections.deque()
        self.out: collections.deque[Any] = collections.deque()
        self.n_requests = self.sent = self.in_flight = self.most_in_flight = 0

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        await trio.lowlevel.checkpoint()
        msg = parse_message(frame, LIMITS)
        assert isinstance(msg, RangeRequest)
        self.asked.append(msg)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

    async def receive(self, timeout: float | None = None) -> Frame:
        await trio.lowlevel.checkpoint()
        if self.closed or (self.cut_after is not None and self.sent >= self.cut_after):
            raise PeerLost(f"peer {self.peer} closed the stream")
        if not self.out:
            r = self.asked.popleft()
            self.n_requests += 1
            self.in_flight -= 1
            if self.n_requests in self.refuse:
                self.out.append(RangeRefused(r.req, "busy", "try another"))
            else:
                with open(self.base / r.file, "rb") as fh:
                    fh.seek(r.offset)
                    data = fh.read(r.length)
                if self.n_requests in self.flip:
                    data = bytes([data[0] ^ 1]) + data[1:]
                self.out.extend(data_frames(r.req, r.offset, data, LIMITS))
        self.sent += 1
        return self.out.popleft().to_frame()  # type: ignore[no-any-return]


def _assignment(m: ModelManifest, peers: tuple[str, ...] = ("m",)) -> tuple[Assignment, Assignment]:
    everything = Holds.of_layers(m, range(m.n_layers), head=True)
    files = file_pieces(m, [f.path for f in m.weight_files()])
    tensors = tensor_pieces(m.block(0, m.n_layers), LIMITS.max_range_bytes)
    return Assignment(files, dict.fromkeys(peers, everything)), Assignment(tensors, dict.fromkeys(peers, everything))


async def _fetch(fs: Any, cache: ModelCache, a: Assignment, peer: str = "m", **kw: Any) -> None:
    await fetch_pieces(fs, cache, a, peer, itertools.count(1), LIMITS, 5.0, **kw)


async def test_several_requests_are_in_flight_and_every_tensor_lands_checked(model: tuple[Path, ModelManifest],
                                                                             tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m)
    member = Member(d)
    await _fetch(member, cache, fa)
    await _fetch(member, cache, ta)
    assert member.most_in_flight == DEPTH >= 2 and member.in_flight == 0
    assert not ta.pending and not ta.liars and not ta.failed
    assert ta.by_peer["m"] == sum(p.nbytes for p in ta.pieces)  # each piece landed once
    assert cache.holds(m.block(0, m.n_layers)) and ModelCache(tmp_path / "c", m).verified == cache.verified


async def test_a_cut_mid_pipeline_gives_back_what_did_not_land_and_another_member_finishes(
        model: tuple[Path, ModelManifest], tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m, ("m", "n"))
    await _fetch(Member(d), cache, fa)
    cutter = Member(d, cut_after=20)  # a few pieces in, with DEPTH requests in flight
    with pytest.raises(PeerLost):
        await _fetch(cutter, cache, ta)
    landed_first = ta.by_peer.get("m", 0)
    assert 0 < landed_first < sum(p.nbytes for p in ta.pieces)
    assert all(t.name in cache.verified for p in ta.pieces if p not in ta.pending for t in p.tensors)
    back = [p for p in ta.pending if "m" in ta.tried.get(p, ())]
    assert back and all(not any(t.name in cache.verified for t in p.tensors) for p in back)
    ta.failed["m"] = "cut"  # as the worker records it
    other = Member(d, peer="n")
    await _fetch(other, cache, ta, peer="n")
    assert not ta.pending and ta.by_peer["m"] + ta.by_peer["n"] == sum(p.nbytes for p in ta.pieces)  # none twice
    assert cache.holds(m.block(0, m.n_layers))


async def test_a_busy_refusal_mid_pipeline_gives_that_piece_back_and_the_stream_goes_on(
        model: tuple[Path, ModelManifest], tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m)
    await _fetch(Member(d), cache, fa)
    member = Member(d, refuse={2})
    await _fetch(member, cache, ta)
    assert len(ta.pending) == 1 and "m" in ta.tried[ta.pending[0]] and not ta.failed and not ta.liars
    refused: Piece = ta.pending[0]
    assert all(t.name not in cache.verified for t in refused.tensors)
    rest = [t for p in ta.pieces if p is not refused for t in p.tensors]
    assert cache.holds(rest) and member.in_flight == 0


async def test_a_flipped_byte_mid_pipeline_names_the_member_a_liar(model: tuple[Path, ModelManifest],
                                                                   tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m)
    await _fetch(Member(d), cache, fa)
    await _fetch(Member(d, flip={3}), cache, ta)
    assert "failed sha256" in ta.liars["m"]
    assert ta.pending and all(t.name not in cache.verified for p in ta.pending for t in p.tensors)
    assert len(cache.verified & {t.name for t in m.block(0, m.n_layers)}) > 0  # the honest ones kept


async def test_a_fast_channel_closed_before_any_answer_hands_every_piece_taken_back(
        model: tuple[Path, ModelManifest], tmp_path: Path) -> None:  # fmt: skip
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m)
    await _fetch(Member(d), cache, fa)
    with pytest.raises(NoFastPath) as e:
        await _fetch(Member(d, closed=True), cache, ta, unproven=True)
    assert len(e.value.pieces) >= 1 and not ta.tried and not ta.failed  # none given back: they go over libp2p
    await _fetch(Member(d), cache, ta, first=e.value.pieces)
    assert not ta.pending and cache.holds(m.block(0, m.n_layers))


class ViewMember(Member):
    """A fast channel's frame link: each frame is written into the buffer the asker passes
    (as FastChannel.receive opens a direct message into it), and handed back as a view of it."""

    opens_into = True

    def __init__(self, base: Path, **kw: Any) -> None:
        super().__init__(base, **kw)
        self.buffers: list[bytearray] = []
        self.into = 0

    async def receive_view(self, timeout: float | None = None, *, into: bytearray | None = None) -> Frame:
        raw = encode_frame(await self.receive(timeout), LIMITS)
        assert into is not None and len(into) >= len(raw)
        if not any(b is into for b in self.buffers):
            self.buffers.append(into)
        self.into += 1
        into[: len(raw)] = raw
        return decode_frame(memoryview(into)[: len(raw)], LIMITS, view=True)


async def test_a_receive_buffer_is_reused_only_after_its_bytes_landed(model: tuple[Path, ModelManifest],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Landing is slowed, so the queue of frames not landed yet is full while more arrive: a
    buffer given back before its bytes were written and hashed would be overwritten by a later
    frame, and that tensor would fail its sha256 (the member named a liar)."""
    d, m = model
    slow_take = PieceSink.take

    def take(self: PieceSink, data: bytes) -> None:
        time.sleep(0.002)
        slow_take(self, data)

    monkeypatch.setattr(PieceSink, "take", take)
    cache = ModelCache(tmp_path / "c", m)
    fa, ta = _assignment(m)
    await _fetch(ViewMember(d), cache, fa)
    member = ViewMember(d)
    await _fetch(member, cache, ta)
    assert not ta.liars and not ta.failed and not ta.pending
    assert cache.holds(m.block(0, m.n_layers))
    assert len(member.buffers) <= 2 * WRITE_AHEAD + 1 < member.into  # each frame in one, reused
