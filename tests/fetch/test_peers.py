"""What a member may serve (Holdings) and which member is asked for what (Assignment), no sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.fetch.cache import SAVE_EVERY_S, ModelCache
from swarm.fetch.origin import FetchError
from swarm.fetch.peers import (
    Assignment,
    Holdings,
    Holds,
    PieceSink,
    RangeRefused,
    file_pieces,
    tensor_pieces,
)
from swarm.manifest.model_manifest import ModelManifest, manifest_of_path
from swarm.testing.checkpoints import TinySpec, write_checkpoint

SPEC = TinySpec(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, intermediate_size=128, vocab_size=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelManifest]:
    d = write_checkpoint(tmp_path_factory.mktemp("peers") / "tiny", SPEC, shards=2)
    return d, manifest_of_path(d)


def test_without_rwf_nowait_every_read_goes_to_a_worker_thread(model: tuple[Path, ModelManifest],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Where preadv has no "page cache only" flag (not Linux), a cached-only read says no and
    touches nothing, so the member reads in a worker thread; the plain read is unchanged."""
    from swarm.fetch import peers

    d, m = model
    t0 = m.block(1, 2)[0]
    held = Holdings(m, d, [t0.name], [t0.file])
    monkeypatch.setattr(peers, "_NOWAIT", None)
    buf = bytearray(8)
    assert not held.read_into(t0.file, t0.start, [memoryview(buf)], cached_only=True) and buf == bytearray(8)
    assert held.read_into(t0.file, t0.start, [memoryview(buf)])
    assert buf == (d / t0.file).read_bytes()[t0.start : t0.start + 8]


def test_a_member_serves_only_what_it_holds_verified(model: tuple[Path, ModelManifest]) -> None:
    d, m = model
    t0, t1 = (t for t in sorted(m.block(1, 2), key=lambda t: (t.file, t.start))[:2])
    held = Holdings(m, d, [t0.name], [m.weight_files()[0].path])
    held.check(t0.file, t0.start, t0.nbytes, 1 << 20)
    bufs = [bytearray(3), bytearray(5)]  # one read, into each buffer in turn
    held.read_into(t0.file, t0.start, [memoryview(b) for b in bufs])
    assert bufs[0] + bufs[1] == (d / t0.file).read_bytes()[t0.start : t0.start + 8]
    with pytest.raises(FetchError, match="shrank"):  # past the file's end: short, never padded
        held.read_into(t0.file, m.files[t0.file].size - 2, [memoryview(bytearray(4))])
    # from the page cache only (an event loop's read): the same bytes, or False, never a short read
    cached = [bytearray(8)]
    if held.read_into(t0.file, t0.start, [memoryview(b) for b in cached], cached_only=True):
        assert cached[0] == bufs[0] + bufs[1]
    assert not held.read_into(t0.file, m.files[t0.file].size - 2, [memoryview(bytearray(4))], cached_only=True)
    ahead = bytearray(8)  # a worker thread's read, the rest of the range read ahead by the kernel
    held.read_ahead(t0.file, t0.start, [memoryview(ahead)], t0.end)
    assert ahead == bufs[0] + bufs[1]
    cases = [
        ((t0.file, t0.start, t0.nbytes + 1), "not-held"),  # one byte past what is held
        ((t0.file, t0.start - 1, 2), "not-held") if t0.start > m.files[t0.file].header_end else None,
        ((t1.file, t1.start, t1.nbytes), "not-held"),
        (("../../etc/passwd", 0, 1), "unknown-file"),
        ((t0.file, t0.start, 1 << 21), "too-large"),
    ]
    for args, code in filter(None, cases):
        with pytest.raises(RangeRefused) as e:
            held.check(*args, 1 << 20)  # type: ignore[misc]
        assert e.value.code == code, args
    hdr = m.weight_files()[0]
    held.check(hdr.path, 0, hdr.header_end, 1 << 20)  # a header held is served too
    assert Holdings(m, d, [], []).layers() == [] and Holdings(m, d, m.tensors, []).layers() == [0, 1, 2, 3]


def test_pieces_join_adjacent_tensors_up_to_the_cap(model: tuple[Path, ModelManifest]) -> None:
    _, m = model
    ts = m.block(0, 4)
    pieces = tensor_pieces(ts, 1 << 20)
    assert sorted(t.name for p in pieces for t in p.tensors) == sorted(t.name for t in ts)
    assert all(p.tensors[-1].end == p.end and p.tensors[0].start == p.start for p in pieces)
    assert all(a.end == b.start and a.layer == b.layer for p in pieces for a, b in zip(p.tensors, p.tensors[1:], strict=False))
    assert len(tensor_pieces(m.block(0, 4) + m.head(), 1 << 30)) >= 4 + len({t.file for t in m.head()})  # never two layers
    big = max(ts, key=lambda t: t.nbytes)
    alone = tensor_pieces(ts, big.nbytes - 1)
    assert any(p.tensors == (big,) for p in alone) and all(p.nbytes < big.nbytes or len(p.tensors) == 1 for p in alone)
    assert [(a, b) for a, b in alone[0].ranges(10)][:2] == [(alone[0].start, alone[0].start + 10), (alone[0].start + 10, alone[0].start + 20)]


def test_each_piece_goes_to_a_holder_and_a_liar_gets_nothing_more(model: tuple[Path, ModelManifest]) -> None:
    _, m = model
    pieces = tensor_pieces(m.block(0, 4), 1 << 12)
    holders = {"A": Holds.of_layers(m, [0, 1]), "B": Holds.of_layers(m, [0, 1, 2, 3]), "C": Holds()}
    a = Assignment(pieces, holders)
    first = a.take("A")
    assert first is not None and holders["A"].has(first)
    assert a.take("C") is None  # holds nothing
    # B takes the pieces only it holds first (layers 2, 3), leaving the shared ones for A
    b1 = a.take("B")
    assert b1 is not None and not holders["A"].has(b1)
    a.give_back(first, "A", "sha256 mismatch", lied=True)
    assert a.liars == {"A": "sha256 mismatch"} and a.take("A") is None
    assert a.candidates(first) == ["B"]
    taken = []
    while (p := a.take("B")) is not None:
        taken.append(p)
        a.landed(p, "B")
    assert len(taken) == len(pieces) - 1 and a.left_for_origin() == []
    # nobody holds layer 3: its pieces are the origin's
    a = Assignment(pieces, {"A": holders["A"]})
    while (p := a.take("A")) is not None:
        a.landed(p, "A")
    assert {t.layer for p in a.left_for_origin() for t in p.tensors} == {2, 3}
    a.give_back(pieces[0], "A", "not held (an advert older than its cache)", drop=False)
    assert not a.failed and a.usable("A") and pieces[0] in a.left_for_origin()  # A refused it: not again
    a.give_back(pieces[1], "A", "timed out")
    assert a.failed == {"A": "timed out"} and a.take("A") is None


def test_holds_of_layers_is_what_a_block_fetch_lands(model: tuple[Path, ModelManifest]) -> None:
    _, m = model
    h = Holds.of_layers(m, [2])
    assert {t.name for t in m.block(2, 3)} <= h.tensors and not {t.name for t in m.head()} & h.tensors
    assert {f.path for f in m.weight_files()} <= h.files
    assert all(h.has(p) for p in file_pieces(m, [f.path for f in m.weight_files()]))
    head = Holds.of_layers(m, [], head=True)
    assert {t.name for t in m.head()} <= head.tensors and {f.path for f in m.small_files()} <= head.files


def test_a_piece_lands_only_the_tensors_whose_hash_matches(model: tuple[Path, ModelManifest], tmp_path: Path) -> None:
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    for p in file_pieces(m, [f.path for f in m.weight_files()]):
        s = PieceSink(cache, p)
        s.take((d / p.file).read_bytes()[p.start : p.end])
        assert s.finish() == []
    piece = next(p for p in tensor_pieces(m.block(1, 2), 1 << 20) if len(p.tensors) >= 2)
    raw = bytearray((d / piece.file).read_bytes()[piece.start : piece.end])
    raw[piece.tensors[1].start - piece.start] ^= 1  # the second tensor's first byte
    cache.partial[piece.tensors[1].name] = 3  # an origin's cut transfer: its prefix is overwritten now
    s = PieceSink(cache, piece)
    assert piece.tensors[1].name not in cache.partial
    for i in range(0, len(raw), 100):  # any cut of the bytes
        s.take(bytes(raw[i : i + 100]))
    assert s.finish() == [piece.tensors[1].name]
    assert piece.tensors[0].name in cache.verified and piece.tensors[1].name not in cache.verified
    assert piece.tensors[1].name not in ModelCache(tmp_path / "c", m).verified  # never listed held
    cache.save()  # as the fetch does once its pieces stop (rangepipe.py)
    assert ModelCache(tmp_path / "c", m).verified == cache.verified
    bad_header = file_pieces(m, [m.weight_files()[0].path])[0]
    s = PieceSink(ModelCache(tmp_path / "c2", m), bad_header)
    s.take(bytes(bad_header.nbytes))
    assert s.finish() == [bad_header.file]
    with pytest.raises(Exception, match="header is not in the cache"):
        PieceSink(ModelCache(tmp_path / "c3", m), piece)


def test_landed_pieces_are_saved_at_most_every_half_second(model: tuple[Path, ModelManifest], tmp_path: Path) -> None:
    """PieceSink.finish saves the state only when SAVE_EVERY_S passed since the last save (the
    clock is the test's): a kill loses at most that much, never lists a tensor not verified."""
    d, m = model
    cache = ModelCache(tmp_path / "c", m)
    now = [100.0]
    cache.clock = lambda: now[0]
    for p in file_pieces(m, [f.path for f in m.weight_files()]):
        s = PieceSink(cache, p)
        s.take((d / p.file).read_bytes()[p.start : p.end])
        assert s.finish() == []
    on_disk = lambda: ModelCache(tmp_path / "c", m).verified  # noqa: E731
    pieces = tensor_pieces(m.block(0, m.n_layers), 1 << 20)
    assert len(pieces) >= 3 and SAVE_EVERY_S == 0.5
    for i, piece in enumerate(pieces[:3]):  # 0.2, 0.4, 0.6 s after the headers' save
        now[0] += 0.2
        s = PieceSink(cache, piece)
        s.take((d / piece.file).read_bytes()[piece.start : piece.end])
        assert s.finish() == []
        assert {t.name for t in piece.tensors} <= cache.verified
        assert on_disk() == (cache.verified if i == 2 else set())  # due only at 0.6 s


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.integers(-64, 64), st.integers(-2, 1 << 14), st.integers(0, 2**32 - 1),
       st.booleans())  # fmt: skip
def test_a_request_is_served_only_inside_held_bytes(model: tuple[Path, ModelManifest], which: int, delta: int,
                                                    length: int, seed: int, odd_path: bool) -> None:  # fmt: skip
    """For any request: refused with a RangeRefused, or every byte of it lies in a held tensor or
    header (never a hole, never another file's path, never over the cap)."""
    import random

    d, m = model
    rnd = random.Random(seed)
    names = sorted(m.tensors)
    held_t = {n for n in names if rnd.random() < 0.7}
    held_f = {f.path for f in m.files.values() if rnd.random() < 0.7}
    h = Holdings(m, d, held_t, held_f)
    t = m.tensors[names[which % len(names)]]
    path = "../" + t.file if odd_path else t.file
    offset = rnd.choice([t.start, t.end, 0]) + delta
    try:
        h.check(path, offset, length, 1 << 13)
    except RangeRefused as e:
        assert e.code in ("not-held", "too-large", "unknown-file")
        return
    assert 1 <= length <= 1 << 13 and path in m.files and offset >= 0
    spans = [(m.tensors[n].start, m.tensors[n].end) for n in held_t if m.tensors[n].file == path]
    f = m.files[path]
    if path in held_f:
        spans.append((0, f.header_end if f.is_weights else f.size))
    assert all(any(a <= i < b for a, b in spans) for i in range(offset, offset + length))
