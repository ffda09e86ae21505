"""A node's slice of the model fetched before it loads: its block (at every plan, only the layers
it does not hold yet) and, as coordinator, the head and tokenizer (swarm.fetch does the work).

The fetch runs in a worker thread outside the compute limiter, so the forwards of a block already
held keep running meanwhile; what moved is told as a ``fetched`` life event (bytes, the bytes of
what was asked for, seconds, the source) and kept in ``fetched_bytes`` for status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from swarm.fetch.cache import FetchReport, ModelCache
from swarm.fetch.origin import Origin
from swarm.fetch.slices import fetch_block, fetch_head
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

    async def block(self, a: int, b: int) -> FetchReport:
        return await self._run(f"layers [{a}, {b})", [a, b], lambda: fetch_block(self.cache, a, b, self.sources))

    async def head(self) -> FetchReport:
        return await self._run("the head and tokenizer", None, lambda: fetch_head(self.cache, self.sources))

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
