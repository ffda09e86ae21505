"""A node's slice of the model fetched before it loads: its block (at every plan, only the layers
it does not hold yet) and, as coordinator, the head and tokenizer (swarm.fetch does the work).
With the user's own copy (``join --model`` and an invite naming a model manifest) the same
tensors are verified in place instead, each once (a ``verified`` life event).

The fetch runs in a worker thread outside the compute limiter, so the forwards of a block already
held keep running meanwhile; what moved is told as a ``fetched`` life event (bytes, the bytes of
what was asked for, seconds, the source) and kept in ``fetched_bytes`` for status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from swarm.fetch.cache import FetchReport, ModelCache
from swarm.fetch.origin import Origin
from swarm.fetch.slices import fetch_block, fetch_head, verify_block_in_place, verify_head_in_place
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

    async def block(self, a: int, b: int) -> FetchReport:
        if self.local is not None:
            local = self.local
            return await self._verify(f"layers [{a}, {b})", lambda: verify_block_in_place(self.cache, local, a, b))
        return await self._run(f"layers [{a}, {b})", [a, b], lambda: fetch_block(self.cache, a, b, self.sources))

    async def head(self) -> FetchReport:
        if self.local is not None:
            local = self.local
            return await self._verify("the head", lambda: verify_head_in_place(self.cache, local))
        return await self._run("the head and tokenizer", None, lambda: fetch_head(self.cache, self.sources))

    async def _verify(self, what: str, fn: Callable[[], int]) -> FetchReport:
        t0 = time.monotonic()
        hashed = await self.compute.run(fn, limited=False)
        self.notices.life("verified", what=what, bytes=hashed, seconds=round(time.monotonic() - t0, 3))
        return FetchReport(needed=hashed)

    async def _run(self, what: str, layers: list[int] | None, fn: Callable[[], FetchReport]) -> FetchReport:
        async with self.lock:  # one fetch at a time writes the cache's state
            t0 = time.monotonic()
            rep = await self.compute.run(fn, limited=False)
            self.fetched_bytes += rep.fetched
            secs = round(time.monotonic() - t0, 3)
            if rep.fetched:
                self.notices.event(f"fetched {what}: {rep.fetched / 1e6:.1f} MB in {secs:.1f} s")
            self.notices.life("fetched", layers=layers, what=what, bytes=rep.fetched, needed=rep.needed,
                              seconds=secs, sources=rep.by_source)  # fmt: skip
            return rep
