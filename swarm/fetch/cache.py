"""The user's cache of a model's slices: the upstream files, sparse, holding only fetched tensors.

Theory of operation
-------------------
Each weight file lands at its own relative path under ``<cache>/models/<manifest hash[:16]>/``
with its **true length and layout**: its header at byte 0 and each fetched tensor at its own
offset, the rest a hole (a sparse file: it takes no disk). So the cached copy *is* an ordinary
safetensors (or GGUF) file to the existing loaders (``swarm.model.weights`` memory-maps it and
reads only the tensors a stage asks for); a GGUF keeps its quantized blocks exactly as
``swarm.model.gguf`` reads them, and a tensor is fetched at most once, resumed at the byte where
a cut left it.

``.fetch-state.json`` remembers what was verified: tensors (sha256 checked against the manifest
after landing), headers and small files, plus how many bytes of a tensor in progress have
landed. Nothing unverified is ever listed as held; a stage loads only after :meth:`ensure`
returned for exactly its tensors. The disk budget counts what is held plus what a fetch would
add, and is refused before a byte moves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from swarm.fetch.origin import FetchError
from swarm.manifest.model_manifest import FileEntry, ModelManifest, TensorEntry

STATE = ".fetch-state.json"
MANIFEST = "model-manifest.json"
FIXED_MTIME_NS = 1_000_000_000 * 10**9  # a cached file's content is fixed by the manifest, not by when
# its tensors landed: a constant mtime keeps caches keyed by (size, mtime) valid across fetches
# (the tokenizer a GGUF's header converts to, swarm.model.tokenizer)
MERGE_GAP = 4096  # tensors this close share one request (GGUF pads to 32 bytes; safetensors: none)
SAVE_EVERY_S = 0.5  # pieces landing from members: the state file rewritten at most this often
Progress = Callable[[int, int], None]


class Source(Protocol):
    def stream(self, path: str, start: int, end: int, on_bytes: Callable[[int], None] | None = None): ...  # type: ignore[no-untyped-def]

    def url(self, path: str) -> str: ...


@dataclass
class FetchReport:
    fetched: int = 0  # payload bytes landed in the cache by this call
    needed: int = 0  # bytes of what was asked for (tensors, headers, small files), held or not
    tensors: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    # from members: each member's bytes by the path they took (swarm.node.compute.members)
    by_path: dict[str, dict[str, int]] = field(default_factory=dict)
    # seconds spent hashing what landed from an origin (sha256, on the writer thread, so they
    # overlap the receiving); None where not measured (bytes from members)
    verify_s: float | None = None


class DiskBudgetError(FetchError):
    """The cache would exceed the disk budget (``--disk``)."""


class ModelCache:
    def __init__(self, root: Path, manifest: ModelManifest, *, disk_budget: int | None = None) -> None:
        self.manifest = manifest
        self.dir = root / "models" / manifest.digest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.disk_budget = disk_budget
        mf = self.dir / MANIFEST
        if not mf.is_file():
            _atomic_write(mf, manifest.canonical_bytes())
        self._state_path = self.dir / STATE
        try:
            st = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            st = {}
        self.verified: set[str] = set(st.get("verified", [])) & set(manifest.tensors)
        self.files: set[str] = set(st.get("files", [])) & set(manifest.files)  # headers and small files
        self.partial: dict[str, int] = {k: int(v) for k, v in st.get("partial", {}).items() if k in manifest.tensors}
        self.fetched_total: int = int(st.get("fetched_total", 0))  # every byte landed here, ever
        # held by who changes the bookkeeping from a worker thread (pieces of several members land
        # at once): two saves racing on one temporary file lost the state file's rename
        self.lock = threading.RLock()
        self.clock: Callable[[], float] = time.monotonic  # for save_due (a test's own clock)
        self._saved_at = -SAVE_EVERY_S  # clock() at the last save

    @classmethod
    def open(cls, model_dir: Path, *, disk_budget: int | None = None) -> ModelCache:
        """The cache of the model whose directory is ``model_dir`` (``<root>/models/<hash16>``),
        its manifest read from there and checked against the directory's name."""
        from swarm.manifest.model_manifest import parse_model_manifest

        where = model_dir / MANIFEST
        try:
            m = parse_model_manifest(where.read_bytes(), str(where))
        except OSError as e:
            raise FetchError(f"{where}: cannot read the model manifest: {e}") from None
        if m.digest()[:16] != model_dir.name:
            raise FetchError(f"{where}: its hash {m.digest()[:16]} is not its directory's name (a damaged cache: delete {model_dir})")
        return cls(model_dir.parent.parent, m, disk_budget=disk_budget)

    # ------------------------------------------------------------------ bookkeeping
    def save(self) -> None:
        with self.lock:
            st = {"verified": sorted(self.verified), "files": sorted(self.files), "partial": self.partial,
                  "fetched_total": self.fetched_total}  # fmt: skip
            _atomic_write(self._state_path, json.dumps(st).encode())
            self._saved_at = self.clock()

    def save_due(self) -> None:
        """:meth:`save`, unless the last one was under SAVE_EVERY_S ago. For pieces landing from
        members one after another: a save after each rewrote (and renamed) the whole state file
        every 16 MiB, which py-spy showed stalling the landing thread. Whoever lands them saves
        at the end or cut (rangepipe.py), so a kill loses at most SAVE_EVERY_S of landed pieces,
        never listed as held and so fetched again after a restart."""
        if self.clock() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    def held_bytes(self) -> int:
        t = self.manifest.tensors
        f = self.manifest.files
        return (sum(t[n].nbytes for n in self.verified) + sum(self.partial.values())
                + sum(f[p].header_end if f[p].is_weights else f[p].size for p in self.files))  # fmt: skip

    def holds(self, tensors: Sequence[TensorEntry]) -> bool:
        return all(t.name in self.verified for t in tensors)

    def layers_held(self) -> list[int]:
        """Layers whose every tensor is verified here (for adverts and plans)."""
        by: dict[int, bool] = {}
        for t in self.manifest.tensors.values():
            if t.layer is not None:
                by[t.layer] = by.get(t.layer, True) and t.name in self.verified
        return sorted(k for k, v in by.items() if v)

    def check_budget(self, todo: Sequence[TensorEntry], todo_files: Sequence[FileEntry]) -> int:
        """The bytes fetching ``todo`` and ``todo_files`` (none held yet) adds; DiskBudgetError
        if the cache would then exceed the disk budget."""
        adding = sum(_file_bytes(f) for f in todo_files) + sum(t.nbytes - self.partial.get(t.name, 0) for t in todo)
        if self.disk_budget is not None and self.held_bytes() + adding > self.disk_budget:
            raise DiskBudgetError(
                f"disk budget {_gb(self.disk_budget)}: this block needs {_gb(adding)} more and the cache "
                f"({self.dir}) already holds {_gb(self.held_bytes())}: raise --disk, or offer less memory "
                "so that the plan gives this peer fewer layers"
            )
        return adding

    # ------------------------------------------------------------------ fetching
    def ensure(self, tensors: Sequence[TensorEntry], files: Sequence[str], sources: Sequence[Source],
               progress: Progress | None = None) -> FetchReport:  # fmt: skip
        """Fetch and verify what of ``tensors`` and ``files`` (small files whole, weight files'
        headers; the headers of the tensors' files always) is not held yet. FetchError naming
        file and tensor for bytes that fail their hash; the tensors that passed stay held."""
        m = self.manifest
        wanted = sorted({t.file for t in tensors} | set(files))
        todo_files = [m.files[p] for p in wanted if p not in self.files]
        todo = sorted((t for t in tensors if t.name not in self.verified), key=lambda t: (t.file, t.start))
        report = FetchReport(needed=sum(t.nbytes for t in tensors) + sum(_file_bytes(m.files[p]) for p in wanted),
                             verify_s=0.0)  # fmt: skip
        if not todo and not todo_files:
            return report
        if not sources:
            raise FetchError(f"{self.dir}: {len(todo)} tensors and {len(todo_files)} files are not in the cache "
                             "and there is no source to fetch them from (the invite names no origin)")  # fmt: skip
        total, done = self.check_budget(todo, todo_files), 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            self.fetched_total += n
            if progress is not None:
                progress(done, total)

        src = sources[0]  # one origin at a time (members serve each other: swarm.fetch.peers)
        key = src.url("").rstrip("/")
        bad: list[str] = []
        hash_s = 0.0
        try:
            for f in todo_files:
                hash_s += self._land_file(f, src, tick)
            for run in _runs(todo, self.partial):
                run_bad, run_s = self._land_run(run, src, tick)
                bad += run_bad
                hash_s += run_s
        finally:
            self.save()
        report.verify_s = hash_s
        report.fetched = done
        report.tensors = len(todo) - len(bad)
        report.by_source[key] = done
        if bad:
            raise FetchError(f"the origin {key} sent bytes that are not the manifest's: {'; '.join(bad[:4])}"
                             f"{f' (and {len(bad) - 4} more)' if len(bad) > 4 else ''}: its files changed since "
                             "the manifest was made (another revision?); the tensors that matched are kept")  # fmt: skip
        return report

    def _land_file(self, f: FileEntry, src: Source, tick: Callable[[int], None]) -> float:
        """Fetch, check and write a header or small file; returns the seconds spent hashing."""
        n = f.header_end if f.is_weights else f.size
        data = b"".join(src.stream(f.path, 0, n, tick))
        want = f.header_sha256 if f.is_weights else f.sha256
        t0 = time.perf_counter()
        ok = hashlib.sha256(data).hexdigest() == want
        hash_s = time.perf_counter() - t0
        if not ok:
            what = "header" if f.is_weights else "contents"
            raise FetchError(f"{src.url(f.path)}: the file's {what} differ from the manifest's (sha256): "
                             "the origin's file changed since the manifest was made")  # fmt: skip
        self.land_file_bytes(f, data)
        return hash_s

    def land_file_bytes(self, f: FileEntry, data: bytes) -> None:
        """Write a weight file's header (laying the file out at its true length) or a small
        file whole, already checked against the manifest, and list it as held."""
        path = self.dir / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "wb") as fh:
            fh.write(data)
            if f.is_weights:
                fh.truncate(f.size)  # the true length; tensors not fetched stay holes
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        self.files.add(f.path)

    def _land_run(self, run: list[TensorEntry], src: Source, tick: Callable[[int], None]) -> tuple[list[str], float]:
        """Stream one contiguous run of tensors into place, hashing each tensor's bytes as they
        pass (a resumed tensor's landed prefix is read back once) and checking it as it completes.
        Returns the tensors that failed their hash and the seconds spent hashing.

        The receiving thread only receives; one helper thread writes and hashes, in order, from
        a bounded queue (both release the GIL, so they overlap the socket reads: measured with
        benchmarks/bench_fetch.py, inline writing and hashing made the fetch 0.67x curl)."""
        first, last = run[0], run[-1]
        pos = first.start + self.partial.get(first.name, 0)
        bad: list[str] = []
        failed: list[BaseException] = []
        chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        with open(self.dir / first.file, "r+b") as fh:
            fh.seek(pos)
            land = _Lander(self, run, fh, pos, bad)

            def consume() -> None:
                try:
                    while (chunk := chunks.get()) is not None:
                        land.take(chunk)
                except BaseException as e:  # handed to the receiving thread, which raises it
                    failed.append(e)
                    while chunks.get() is not None:
                        pass

            helper = threading.Thread(target=consume, name="fetch-writer", daemon=True)
            helper.start()
            try:
                for chunk in src.stream(first.file, pos, last.end, tick):
                    if failed:
                        break
                    chunks.put(chunk)
            finally:
                chunks.put(None)
                helper.join()
        os.utime(self.dir / first.file, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        if failed:
            raise failed[0]
        return bad, land.hash_s


class _Lander:
    """Writes a run's bytes at their offsets and checks each tensor's sha256 as it completes."""

    def __init__(self, cache: ModelCache, run: list[TensorEntry], fh: Any, pos: int, bad: list[str]) -> None:
        self.cache, self.run, self.fh, self.pos, self.bad = cache, run, fh, pos, bad
        self.i = 0
        self.h: Any = None
        self.hash_s = 0.0  # seconds in sha256 (the verify part of the fetch)

    def take(self, chunk: bytes) -> None:
        c, run, fh = self.cache, self.run, self.fh
        fh.write(chunk)
        view, off = memoryview(chunk), 0
        while off < len(chunk) and self.i < len(run):
            t, at = run[self.i], self.pos + off
            if at < t.start:  # padding between two tensors
                off += min(t.start - at, len(chunk) - off)
                continue
            if self.h is None:
                self.h = hashlib.sha256()
                if at > t.start:  # resumed: the prefix that landed before the cut
                    fh.flush()
                    self.h.update(os.pread(fh.fileno(), at - t.start, t.start))
            take = min(t.end - at, len(chunk) - off)
            t0 = time.perf_counter()
            self.h.update(view[off : off + take])
            self.hash_s += time.perf_counter() - t0
            off += take
            if at + take < t.end:
                c.partial[t.name] = at + take - t.start
                continue
            c.partial.pop(t.name, None)
            t0 = time.perf_counter()
            ok = self.h.hexdigest() == t.sha256
            self.hash_s += time.perf_counter() - t0
            if ok:
                c.verified.add(t.name)
            else:
                self.bad.append(f"{t.file}: tensor {t.name}")
            self.i, self.h = self.i + 1, None
        self.pos += len(chunk)
        if c.partial and self.pos % (64 << 20) < len(chunk):
            fh.flush()
            c.save()  # a kill loses at most 64 MiB of progress


def _runs(todo: list[TensorEntry], partial: dict[str, int]) -> list[list[TensorEntry]]:
    runs: list[list[TensorEntry]] = []
    for t in todo:
        if runs and runs[-1][-1].file == t.file and 0 <= t.start - runs[-1][-1].end <= MERGE_GAP and t.name not in partial:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _file_bytes(f: FileEntry) -> int:
    return f.header_end if f.is_weights else f.size


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o644)
