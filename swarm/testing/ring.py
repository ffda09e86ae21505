"""A whole ring in one trio task tree over the in-memory network (for fast tests and fakes).

``run_memory_ring`` wires a Coordinator and one StageWorker per block with MemLinks (optionally
delayed), runs one or more generations concurrently, and returns their results and the links, so
tests can cut a link mid-generation or count frames.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from swarm.model.driver import GenerationResult
from swarm.model.generate import LocalModel
from swarm.node.compute.runtime import Compute
from swarm.node.ring.coordinator import Coordinator
from swarm.node.ring.stage_worker import StageWorker
from swarm.testing.memnet import MemLink


@dataclass
class MemoryRing:
    coordinator: Coordinator
    workers: list[StageWorker]
    links: list[MemLink]  # hop i: into stage i (the last one: tail -> coordinator)


async def run_memory_ring(
    model: LocalModel,
    jobs: Sequence[Callable[[Coordinator], Awaitable[GenerationResult]]],
    *,
    delay: float = 0.0,
    epoch: int = 1,
    chunk_timeout: float = 30.0,
    during: Callable[[MemoryRing], Awaitable[None]] | None = None,
    compute_delay_s: float = 0.0,
    trace: bool = False,
    gather: bool = True,
) -> tuple[list[GenerationResult | BaseException], MemoryRing]:
    """Run ``jobs`` (each gets the coordinator) concurrently on a ring made of ``model``'s stages.
    ``compute_delay_s``: every forward blocks this much longer (load tests); ``trace``: each
    worker records its batches (``worker.trace``); ``gather``: workers wait for sessions due
    before a forward (stage_worker.py)."""
    n = len(model.stages)
    names = ["coord"] + [f"stage{i}" for i in range(n)] + ["coord"]
    links = [MemLink(f"{names[i]}->{names[i + 1]}", delay=delay) for i in range(n + 1)]
    coord = Coordinator(
        model.head, epoch=epoch, first_hop=names[1], chunk_timeout=chunk_timeout, compute=Compute(),
        compute_delay_s=compute_delay_s,
    )  # fmt: skip
    coord.attach(links[0])
    workers = [
        StageWorker(st, epoch=epoch, upstream=names[i], is_tail=(i == n - 1), compute=Compute(),  # each a process's
                    compute_delay_s=compute_delay_s)  # fmt: skip
        for i, st in enumerate(model.stages)
    ]
    for w in workers:
        w.trace = [] if trace else None
        w.gathering.enabled = gather
    ring = MemoryRing(coord, workers, links)
    results: list[GenerationResult | BaseException] = [RuntimeError("not run")] * len(jobs)

    async def one(i: int, job: Callable[[Coordinator], Awaitable[GenerationResult]]) -> None:
        try:
            results[i] = await job(coord)
        except Exception as exc:  # recorded for the test to inspect
            results[i] = exc

    async with trio.open_nursery() as infra:
        for i, w in enumerate(workers):
            infra.start_soon(w.serve, links[i], links[i + 1])
        infra.start_soon(_results, coord, links[n], names[n])
        async with trio.open_nursery() as gens:
            for i, job in enumerate(jobs):
                gens.start_soon(one, i, job)
            if during is not None:
                gens.start_soon(during, ring)
        infra.cancel_scope.cancel()
    return results, ring


async def _results(coord: Coordinator, link: MemLink, tail: str) -> None:
    try:
        await coord.serve_results(link, tail_peer=tail)
    except Exception:
        return
