"""Model bytes between members: what a member may serve, and which member to ask for what.

Theory of operation
-------------------
A member serves byte ranges of the model's files that it holds *verified* (tensors whose sha256
matched the manifest, headers and small files likewise): :class:`Holdings` answers whether a
request lies wholly inside such bytes (a typed :class:`RangeRefused` otherwise) and reads them
(``read_into``: straight into the caller's buffers).
Nothing else of the file is ever read: a sparse cache's holes, a tensor still landing, a path
outside the manifest are all refused before a byte is touched.

A member that needs tensors cuts them into :class:`Piece` s: a run of tensors adjacent in their
file (at most ``max_bytes`` together; one larger tensor is a piece of its own, asked in several
ranges), or one weight file's header, or one small file. :class:`Assignment` hands pieces to
peers that hold all of a piece (several peers at once, each taking the next piece it can serve,
so a faster peer takes more); a piece a peer failed or lied about goes back, never again to that
peer; a liar or a failed peer gets no more pieces at all. What no peer can serve is left for the
origin. Every piece is checked as it lands (:class:`PieceSink`): each tensor against its sha256,
a header or small file whole; only then is it listed in the cache as held.

This module is pure and synchronous (no trio, no sockets): node/ pumps the bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.fetch.cache import FIXED_MTIME_NS, ModelCache
from swarm.fetch.origin import FetchError
from swarm.manifest.model_manifest import FileEntry, ModelManifest, TensorEntry

PIECE_BYTES = 16 << 20  # adjacent tensors asked of one peer together, at most


class RangeRefused(FetchError):
    """A member will not serve a range: ``code`` is one of swarm.proto.tensors.REFUSALS."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------- serving side


class Holdings:
    """The verified bytes of a model under ``base`` (a cache directory or a user's own copy):
    ``tensors`` by name, ``files`` (weight files' headers, small files whole) by path."""

    def __init__(self, manifest: ModelManifest, base: Path, tensors: Collection[str], files: Collection[str]) -> None:
        self.manifest, self.base = manifest, base
        spans: dict[str, list[tuple[int, int]]] = {}
        for name in tensors:
            t = manifest.tensors.get(name)
            if t is not None:
                spans.setdefault(t.file, []).append((t.start, t.end))
        for path in files:
            f = manifest.files.get(path)
            if f is not None:
                spans.setdefault(path, []).append((0, f.header_end if f.is_weights else f.size))
        self.spans = {p: _merge(s) for p, s in spans.items()}

    @classmethod
    def of_cache(cls, cache: ModelCache) -> Holdings:
        return cls(cache.manifest, cache.dir, set(cache.verified), set(cache.files))

    def layers(self) -> list[int]:
        """Layers whose every tensor is held (what an advert says)."""
        by: dict[int, bool] = {}
        for t in self.manifest.tensors.values():
            if t.layer is not None:
                by[t.layer] = by.get(t.layer, True) and self.covers(t.file, t.start, t.end)
        return sorted(k for k, v in by.items() if v)

    def covers(self, path: str, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.spans.get(path, ()))

    def check(self, path: str, offset: int, length: int, max_bytes: int) -> None:
        """RangeRefused unless [offset, offset + length) of ``path`` is held and small enough."""
        if length > max_bytes:
            raise RangeRefused("too-large", f"{length} bytes asked, at most {max_bytes} a request: ask in smaller ranges")
        if path not in self.manifest.files:
            raise RangeRefused("unknown-file", f"{path[:120]!r} is not a file of the model")
        if length < 1 or not self.covers(path, offset, offset + length):
            raise RangeRefused("not-held", f"{path}: bytes [{offset}, {offset + length}) are not all held verified here")

    def read_into(self, path: str, offset: int, views: Sequence[memoryview], *, cached_only: bool = False) -> bool:
        """The bytes of a range :meth:`check` allowed, from ``offset`` on, into ``views`` one
        after another (one preadv: no fresh pages, no copy out of a bytes object).
        ``cached_only``: only if they are all in the page cache already (RWF_NOWAIT: never waits
        on the disk, so an event loop may call it); False (the views partly written or not at
        all) if they are not."""
        length = sum(len(v) for v in views)
        flags = _NOWAIT if cached_only else 0
        if flags is None:  # not Linux: the caller reads in a worker thread
            return False
        try:
            fd = os.open(self.base / path, os.O_RDONLY)
            try:
                got = os.preadv(fd, views, offset, flags)
            finally:
                os.close(fd)
        except BlockingIOError:
            return False
        except OSError as e:
            if cached_only and e.errno == errno.EOPNOTSUPP:  # a file system without RWF_NOWAIT
                return False
            raise FetchError(f"{self.base / path}: cannot read bytes [{offset}, {offset + length}): {e}") from None
        if got != length and not cached_only:
            raise FetchError(f"{self.base / path}: {got} bytes at {offset}, {length} held (the file shrank?)")
        return got == length

    def read_ahead(self, path: str, offset: int, views: Sequence[memoryview], end: int) -> None:
        """:meth:`read_into` (from the disk: a worker thread), then ask the kernel to read the
        rest of the range up to ``end`` into the page cache in the background."""
        self.read_into(path, offset, views)
        after = offset + sum(len(v) for v in views)
        if after < end and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # a hint only
                fd = os.open(self.base / path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, after, end - after, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)


_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)  # preadv's "page cache only" (Linux)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ---------------------------------------------------------------------------- fetching side


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of ``file``: adjacent ``tensors``, or (no tensors) a header or small
    file whose whole bytes hash to ``sha256``."""

    file: str
    start: int
    end: int
    tensors: tuple[TensorEntry, ...] = ()
    sha256: str = ""

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        if not self.tensors:
            return f"{self.file}: {'header' if self.start == 0 and self.sha256 else 'file'} [{self.start}, {self.end})"
        names = ", ".join(t.name for t in self.tensors[:3]) + (f" (+{len(self.tensors) - 3})" if len(self.tensors) > 3 else "")
        return f"{self.file}: {names}"

    def ranges(self, max_bytes: int) -> list[tuple[int, int]]:
        return [(a, min(a + max_bytes, self.end)) for a in range(self.start, self.end, max_bytes)]


def file_pieces(manifest: ModelManifest, paths: Iterable[str]) -> list[Piece]:
    out = []
    for p in sorted(set(paths)):
        f: FileEntry = manifest.files[p]
        if f.is_weights:
            out.append(Piece(p, 0, f.header_end, sha256=str(f.header_sha256)))
        else:
            out.append(Piece(p, 0, f.size, sha256=str(f.sha256)))
    return out


def tensor_pieces(tensors: Iterable[TensorEntry], max_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Runs of tensors of one layer (or of none) adjacent in their file (no gap), each run at
    most ``max_bytes`` (a larger tensor alone): members hold whole layers, so a piece never
    straddles two, and a member holding one layer can serve each of its pieces."""
    runs: list[list[TensorEntry]] = []
    for t in sorted(tensors, key=lambda t: (t.file, t.start)):
        last = runs[-1] if runs else None
        if (last and last[-1].file == t.file and last[-1].end == t.start and last[-1].layer == t.layer
                and t.end - last[0].start <= max_bytes):  # fmt: skip
            last.append(t)
        else:
            runs.append([t])
    return [Piece(r[0].file, r[0].start, r[-1].end, tuple(r)) for r in runs]


@dataclass(frozen=True)
class Holds:
    """What a peer says it holds verified: tensor names and files (headers, small files)."""

    tensors: frozenset[str] = frozenset()
    files: frozenset[str] = frozenset()

    @classmethod
    def of_layers(cls, manifest: ModelManifest, layers: Iterable[int], *, head: bool = False) -> Holds:
        """A member holding ``layers`` (whole), as its advert says: their tensors, the config
        tensors and every weight header (fetch_block lands those); the head's with ``head``."""
        ls = set(layers)
        names = {t.name for t in manifest.tensors.values() if t.layer in ls}
        if ls:
            names |= {t.name for t in manifest.block(0, 0)}
        files = {f.path for f in manifest.weight_files()} if ls or head else set()
        files |= {p for p in ("config.json", "model.safetensors.index.json") if p in manifest.files and (ls or head)}
        if head:
            names |= {t.name for t in manifest.head()}
            files |= {f.path for f in manifest.small_files()}
        return cls(frozenset(names), frozenset(files))

    def has(self, piece: Piece) -> bool:
        if piece.tensors:
            return all(t.name in self.tensors for t in piece.tensors)
        return piece.file in self.files


@dataclass
class Assignment:
    """Which peer fetches which piece, decided as the peers ask for work (see the module's
    docstring). Peers in ``holders`` only; ``failed``/``liars`` say why a peer was dropped."""

    pieces: Sequence[Piece]
    holders: Mapping[str, Holds]
    pending: list[Piece] = field(init=False)
    tried: dict[Piece, set[str]] = field(init=False, default_factory=dict)
    failed: dict[str, str] = field(init=False, default_factory=dict)
    liars: dict[str, str] = field(init=False, default_factory=dict)
    by_peer: dict[str, int] = field(init=False, default_factory=dict)  # bytes each peer landed

    def __post_init__(self) -> None:
        self.pending = list(self.pieces)

    def candidates(self, piece: Piece) -> list[str]:
        tried = self.tried.get(piece, set())
        return [p for p, h in self.holders.items() if h.has(piece) and p not in tried and self.usable(p)]

    def usable(self, peer: str) -> bool:
        return peer in self.holders and peer not in self.failed and peer not in self.liars

    def take(self, peer: str) -> Piece | None:
        """The next piece ``peer`` should fetch, or None (nothing left that it can serve).
        Prefers a piece few other peers can serve, so the widely held ones stay for the rest."""
        if not self.usable(peer):
            return None
        best: tuple[int, int] | None = None
        for i, piece in enumerate(self.pending):
            c = self.candidates(piece)
            if peer in c and (best is None or len(c) < best[0]):
                best = (len(c), i)
                if len(c) == 1:
                    break
        if best is None:
            return None
        return self.pending.pop(best[1])

    def landed(self, piece: Piece, peer: str) -> None:
        self.by_peer[peer] = self.by_peer.get(peer, 0) + piece.nbytes

    def give_back(self, piece: Piece, peer: str, why: str, *, lied: bool = False, drop: bool = True) -> None:
        """``peer`` did not land ``piece``: it goes back (never to ``peer``) and ``peer`` is
        dropped: a liar for bytes that failed their hash, else as failed (timeout, loss, a broken
        protocol); with ``drop`` False (it refused that piece: its advert was out of date) it
        keeps serving the others."""
        self.tried.setdefault(piece, set()).add(peer)
        self.pending.append(piece)
        if lied:
            self.liars.setdefault(peer, why)
        elif drop:
            self.failed.setdefault(peer, why)

    def left_for_origin(self) -> list[Piece]:
        """What is still pending (call when every peer's worker has stopped)."""
        return list(self.pending)


class PieceSink:
    """Lands one piece's bytes in the cache as they arrive, in order, hashing as it goes.

    Tensor pieces are written in place; :meth:`finish` marks each tensor whose hash matched as
    verified and returns the names of those that did not. A header or small file is kept in
    memory (a few MB) and written only if its whole hash matches.
    The cache's state file is saved at most every SAVE_EVERY_S from here
    (ModelCache.save_due): whoever lands pieces saves it once they stop."""

    def __init__(self, cache: ModelCache, piece: Piece) -> None:
        self.cache, self.piece = cache, piece
        self.pos = piece.start
        self.i = 0
        self.h = hashlib.sha256()
        self.good: list[str] = []
        self.bad: list[str] = []
        self.buf: list[bytes] = []
        self.fh: Any = None
        if piece.tensors:
            path = cache.dir / piece.file
            if not path.is_file() or piece.file not in cache.files:
                raise FetchError(f"{path}: its header is not in the cache yet (fetch the files first)")
            self.fh = open(path, "r+b")  # noqa: SIM115  (closed in finish/close)
            if any(t.name in cache.partial for t in piece.tensors):  # these bytes are rewritten: an
                for t in piece.tensors:  # origin's cut transfer resumes no more, even after a restart
                    cache.partial.pop(t.name, None)
                cache.save()

    def take(self, data: bytes | memoryview) -> None:
        """The next bytes: written and hashed (or :meth:`write_at` and :meth:`hash_next`, which
        two threads may run at once, each in order, and :meth:`finish` after both)."""
        self.write_at(data, self.pos)
        self.hash_next(data)

    def write_at(self, data: bytes | memoryview, pos: int) -> None:
        """Bytes [pos, pos + len(data)) of a tensor piece written in place (a header or small
        file is written by :meth:`finish` once its hash matched)."""
        p = self.piece
        if not p.start <= pos or pos + len(data) > p.end:
            raise FetchError(f"{p}: {len(data)} bytes at {pos} outside [{p.start}, {p.end})")
        if p.tensors:
            os.pwrite(self.fh.fileno(), data, pos)

    def hash_next(self, data: bytes | memoryview) -> None:
        """The next bytes (in order) into each tensor's sha256, or the whole file's buffer."""
        p = self.piece
        if self.pos + len(data) > p.end:
            raise FetchError(f"{p}: {len(data)} bytes at {self.pos} run past its end {p.end}")
        if not p.tensors:
            self.buf.append(bytes(data))
            self.pos += len(data)
            return
        view, off = memoryview(data), 0
        while off < len(data):
            t = p.tensors[self.i]
            n = min(t.end - (self.pos + off), len(data) - off)
            self.h.update(view[off : off + n])
            off += n
            if self.pos + off == t.end:
                (self.good if self.h.hexdigest() == t.sha256 else self.bad).append(t.name)
                self.i, self.h = self.i + 1, hashlib.sha256()
        self.pos += len(data)

    def finish(self) -> list[str]:
        """Record what passed; the names of what failed its hash (tensors, or the file)."""
        p, c = self.piece, self.cache
        if self.pos != p.end:
            self.close()
            raise FetchError(f"{p}: ended at byte {self.pos}, not {p.end}")
        if not p.tensors:
            data = b"".join(self.buf)
            if hashlib.sha256(data).hexdigest() != p.sha256:
                return [p.file]
            with c.lock:  # pieces of several members land in several threads at once
                c.land_file_bytes(c.manifest.files[p.file], data)
                c.fetched_total += p.nbytes
                c.save_due()
            return []
        self.close()
        os.utime(c.dir / p.file, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        with c.lock:
            for name in self.good:
                c.verified.add(name)
                c.partial.pop(name, None)
            c.fetched_total += p.nbytes
            c.save_due()
        return self.bad

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
