"""A node's slice of the model fetched before it loads: its block (at every plan, only the layers
it does not hold yet) and, as coordinator, the head and tokenizer (swarm.fetch does the work).
With the user's own copy (``join --model`` and an invite naming a model manifest) the same
tensors are verified in place instead, each once (a ``verified`` life event).

The fetch runs in a worker thread outside the compute limiter, so the forwards of a block already
held keep running meanwhile; what moved is told as a ``fetched`` life event (bytes, the bytes of
what was asked for, seconds, of them ``verify_s`` hashing (from an origin), the source) and kept in ``fetched_bytes`` for status.

Once :meth:`BlockFetcher.join_members` wired it (serving.py), the members whose adverts say they
hold the tensors are asked first, several at once (members.py), the origin last; a member whose
bytes failed their hash is never asked again by this node. What this node holds verified (its
cache, or the tensors of its own copy checked in place) is what it serves to the others and what
``on_held`` advertises after each fetch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from swarm.errors import WeightsError
from swarm.fetch.cache import FetchReport, ModelCache
from swarm.fetch.origin import Origin
from swarm.fetch.peers import Holdings, Holds
from swarm.fetch.slices import (
    CONFIG_FILES,
    fetch_block,
    fetch_head,
    verify_block_in_place,
    verify_head_in_place,
    verify_in_place,
)
from swarm.manifest.model_manifest import TensorEntry
from swarm.node.compute.members import DialFast, fetch_from_members
from swarm.node.hosting import Host
from swarm.node.notices import Notices
from swarm.node.settings import NodeSettings


class BlockFetcher:
    def __init__(self, settings: NodeSettings, compute: Any, notices: Notices) -> None:
        assert settings.fetch_dir is not None
        self.cache = ModelCache.open(settings.fetch_dir, disk_budget=settings.disk_bytes or None)
        self.sources = [Origin(u) for u in settings.origin]
        self.compute = compute
        self.notices = notices
        self.fetched_bytes = 0
        self.lock = trio.Lock()
        # a user's own copy (join --model) is verified in place, not fetched
        md = settings.model_dir
        inside = md is not None and (md == settings.fetch_dir or settings.fetch_dir in md.parents)
        self.local: Path | None = None if inside or md is None else (md.parent if md.is_file() else md)
        self._local_held: tuple[set[str], set[str]] = (set(), set())  # tensors, files checked in place
        self.host: Host | None = None
        self.dial_fast: DialFast | None = None
        self.holders: Callable[[], Mapping[str, Holds]] = dict
        self.on_held: Callable[[list[int], bool], None] = lambda layers, head: None
        self.liars: dict[str, str] = {}  # members whose bytes failed their hash: never asked again
        self.report_liar: Callable[[str, str], None] = lambda peer, why: None  # to the leader (join_members)
        self._holdings: tuple[tuple[int, int], Holdings] | None = None
        self._widening = threading.Lock()

    def join_members(self, host: Host, holders: Callable[[], Mapping[str, Holds]],
                     on_held: Callable[[list[int], bool], None], *, dial_fast: DialFast | None = None,
                     report_liar: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        """Ask the members ``holders()`` names (peer -> what its advert says it holds) before the
        origin; ``on_held(layers, head)`` after each fetch or check (to advertise it);
        ``dial_fast``: the fast path to a member, where it serves ranges there (members.py);
        ``report_liar(peer, why)``: a member whose bytes failed their hash, to the leader."""
        self.host, self.holders, self.on_held, self.dial_fast = host, holders, on_held, dial_fast
        if report_liar is not None:
            self.report_liar = report_liar

    def holdings(self) -> Holdings:
        """What this node may serve to members: only bytes it holds verified (rebuilt when that
        grew, not at every request)."""
        tensors, files = self._local_held if self.local is not None else (self.cache.verified, self.cache.files)
        key = (len(tensors), len(files))
        if self._holdings is None or self._holdings[0] != key:
            base = self.local if self.local is not None else self.cache.dir
            self._holdings = (key, Holdings(self.cache.manifest, base, set(tensors), set(files)))
        return self._holdings[1]

    def held(self) -> tuple[list[int], bool]:
        """The layers held verified whole, and whether the head is (for the advert); a node with
        its own full copy holds every layer and the head (each checked when first asked for)."""
        m = self.cache.manifest
        if self.local is not None:
            return sorted({t.layer for t in m.tensors.values() if t.layer is not None}), bool(m.head())
        h = self.holdings()
        return h.layers(), bool(m.head()) and all(h.covers(t.file, t.start, t.end) for t in m.head())

    def disk_left(self) -> int | None:
        """Bytes the disk budget (``--disk``) leaves for model bytes not held yet (for the advert,
        so a plan never gives this node a block it cannot store); None: unbounded."""
        budget = self.cache.disk_budget
        return None if budget is None else max(0, budget - self.cache.held_bytes())

    def widen(self, path: str, offset: int, length: int) -> bool:
        """Own copy only (a worker thread): check in place the tensors (and header) that make up
        [offset, offset + length) of ``path``; True if the range is now held verified."""
        m, local = self.cache.manifest, self.local
        f = m.files.get(path)
        if local is None or f is None:
            return False
        end = offset + length
        if not f.is_weights:  # a small file (config, tokenizer): checked whole
            if end > f.size:
                return False
            with self._widening:
                try:
                    verify_in_place(self.cache, local, [], [path])
                except WeightsError:
                    return False
                self._local_held[1].add(path)
            return True
        inside = [t for t in m.tensors.values() if t.file == path and t.start < end and offset < t.end]
        spans = sorted([(0, f.header_end)] * (offset < f.header_end) + [(t.start, t.end) for t in inside])
        pos = offset
        for a, b in spans:  # the range must be header and tensors only, no gap
            if a > pos:
                return False
            pos = max(pos, b)
        if pos < end:
            return False
        with self._widening:  # verify_in_place rewrites one memo file
            try:
                verify_in_place(self.cache, local, inside, [path])
            except WeightsError:
                return False
            self._local_held[0].update(t.name for t in inside)
            self._local_held[1].add(path)
        return True

    async def block(self, a: int, b: int) -> FetchReport:
        m = self.cache.manifest
        if self.local is not None:
            local = self.local
            return await self._verify(f"layers [{a}, {b})", lambda: verify_block_in_place(self.cache, local, a, b),
                                      m.block(a, b), [p for p in CONFIG_FILES if p in m.files])  # fmt: skip
        files = [f.path for f in m.weight_files()] + [p for p in CONFIG_FILES if p in m.files]
        return await self._run(f"layers [{a}, {b})", [a, b], lambda: fetch_block(self.cache, a, b, self.sources),
                               m.block(a, b), files)  # fmt: skip

    async def head(self) -> FetchReport:
        m = self.cache.manifest
        if self.local is not None:
            local = self.local
            return await self._verify("the head", lambda: verify_head_in_place(self.cache, local),
                                      m.head(), [f.path for f in m.small_files()])  # fmt: skip
        files = [f.path for f in m.weight_files()] + [p for p in CONFIG_FILES if p in m.files]
        return await self._run("the head and tokenizer", None, lambda: fetch_head(self.cache, self.sources),
                               m.head() + m.block(0, 0), files + [f.path for f in m.small_files()])  # fmt: skip

    async def _verify(self, what: str, fn: Callable[[], int], tensors: list[TensorEntry], files: list[str]) -> FetchReport:
        t0 = time.monotonic()

        def locked() -> int:
            with self._widening:  # one writer of the in-place memo at a time (widen, for members)
                return fn()

        hashed = await self.compute.run(locked, limited=False)
        self.notices.life("verified", what=what, bytes=hashed, seconds=round(time.monotonic() - t0, 3))
        self._local_held[0].update(t.name for t in tensors)  # checked: served to members from now on
        self._local_held[1].update(files, (t.file for t in tensors))  # the tensors' files' headers too
        self.on_held(*self.held())
        return FetchReport(needed=hashed)

    def _asking_members(self) -> dict[str, Holds]:
        if self.host is None:
            return {}
        return {p: h for p, h in self.holders().items() if p not in self.liars and p != self.host.peer_id}

    async def _from_members(self, tensors: list[TensorEntry], files: list[str], holders: Mapping[str, Holds]) -> FetchReport:
        assert self.host is not None
        m = self.cache.manifest
        needed = sum(t.nbytes for t in tensors) + sum(
            m.files[p].header_end if m.files[p].is_weights else m.files[p].size for p in set(files) | {t.file for t in tensors})
        rep = await fetch_from_members(self.host, self.cache, tensors, files, holders, self.sources,
                                       on_liar=self._liar, dial_fast=self.dial_fast)  # fmt: skip
        from_members = any(n for k, n in rep.by_source.items() if k in holders)
        return FetchReport(fetched=rep.fetched, needed=needed, tensors=len(tensors), by_source=rep.by_source,
                           by_path=rep.paths, verify_s=None if from_members else rep.origin_verify_s)  # fmt: skip

    def _liar(self, peer: str, why: str) -> None:
        self.liars[peer] = why
        self.notices.notice(f"member {peer} served model bytes that fail the manifest's sha256 ({why[:200]}): "
                            "not asking it again; the bytes were fetched elsewhere; reporting it to the leader")  # fmt: skip
        self.report_liar(peer, why)

    async def _run(self, what: str, layers: list[int] | None, fn: Callable[[], FetchReport],
                   tensors: list[TensorEntry], files: list[str]) -> FetchReport:  # fmt: skip
        async with self.lock:  # one fetch at a time writes the cache's state
            t0 = time.monotonic()
            holders = self._asking_members()
            if holders and not self.cache.holds(tensors):
                rep = await self._from_members(tensors, files, holders)
            else:
                rep = await self.compute.run(fn, limited=False)
            self.fetched_bytes += rep.fetched
            secs = round(time.monotonic() - t0, 3)
            if rep.fetched:
                self.notices.event(f"fetched {what}: {rep.fetched / 1e6:.1f} MB in {secs:.1f} s")
            verify_s = None if rep.verify_s is None else round(rep.verify_s, 3)  # inside ``seconds``
            self.notices.life("fetched", layers=layers, what=what, bytes=rep.fetched, needed=rep.needed,
                              seconds=secs, verify_s=verify_s, sources=rep.by_source, paths=rep.by_path)  # fmt: skip
            self.on_held(*self.held())
            return rep
