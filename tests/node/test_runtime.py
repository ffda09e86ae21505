"""Compute (node/compute/runtime.py), the one hand-off of torch work off the trio loop: a worker
thread behind the process's one limiter (or the one a caller names, such as the draft model's, or
none), inline when it runs inline (in-memory tests on a mock clock); and the only place in node/
that starts a worker thread, the fetch path's disk I/O apart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import trio

from swarm.node.compute.runtime import Compute

NODE = Path(__file__).resolve().parents[2] / "swarm" / "node"
# file I/O of the fetch path, which must not queue behind a forward (runtime.py's docstring)
OWN_THREADS = {"compute/runtime.py", "compute/members.py", "compute/rangepipe.py"}


async def _most_at_once(run: object, n: int = 3) -> int:
    """How many of ``n`` calls of a 50 ms blocking job ``run`` let run at once."""
    now = most = 0
    lock = threading.Lock()

    def job() -> None:
        nonlocal now, most
        with lock:
            now += 1
            most = max(most, now)
        time.sleep(0.05)
        with lock:
            now -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(run, job)  # type: ignore[arg-type]
    return most


async def test_work_leaves_the_loop_behind_one_limiter_unless_told_otherwise() -> None:
    compute = Compute()
    loop = threading.get_ident()
    assert await compute.run(threading.get_ident) != loop
    assert await compute.to_thread(threading.get_ident) != loop  # the hand-off a stage's forward takes
    assert await _most_at_once(compute.run) == 1  # the process's one limiter
    assert await _most_at_once(compute.to_thread) == 1  # ... the same one
    assert await _most_at_once(lambda fn: compute.run(fn, limited=False)) == 3  # a tokenizer's: none
    other = trio.CapacityLimiter(2)  # a draft model's own
    assert await _most_at_once(lambda fn: compute.run(fn, limiter=other)) == 2


async def test_an_inline_compute_runs_the_work_on_the_trio_thread() -> None:
    assert await Compute(threads=False).run(threading.get_ident) == threading.get_ident()


async def test_an_abandoned_call_returns_at_once_while_its_thread_finishes() -> None:
    compute, done = Compute(), threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        done.set()

    t0 = time.monotonic()
    with trio.move_on_after(0.05):
        await compute.run(slow, abandon_on_cancel=True)
    assert time.monotonic() - t0 < 0.25 and not done.is_set()
    done.wait(2)


def test_no_module_of_node_starts_a_thread_but_compute_and_the_fetch_paths_disk_io() -> None:
    starts = {str(p.relative_to(NODE)) for p in NODE.rglob("*.py") if "trio.to_thread" in p.read_text()}
    assert starts <= OWN_THREADS, f"torch work leaves the loop through Compute (runtime.py): {sorted(starts - OWN_THREADS)}"
    assert "compute/runtime.py" in starts  # the check reads what it means to
