"""Files one hidden state passes through at a stage (issue 24's "file hops per stage").

How it counts: a 3-stage ring of a tiny checkpoint decodes a few tokens while
``sys.setprofile``/``threading.setprofile`` record every Python call made on a stage's behalf:
every call whose stack holds a ``StageWorker`` method (its reader, its compute loop, its forward
in a worker thread), from the inbound link's ``receive`` to the outbound link's ``send``; calls
made by ``serve`` itself when the inbound link closes (teardown, after the last hidden state) are
not. A file counts once per stage however often it is entered. Files outside swarm/ (torch, trio,
transformers) are not counted. The ring runs twice, both traced:

- in memory (``swarm.testing.ring``): the hops are ``swarm/testing/memnet.py`` links;
- on the real stack: every hop a :class:`~swarm.node.ring.fastlink.FrameLink` over a sealed
  loopback TCP fast-path channel (``swarm.net.fastpath``), negotiated over an in-memory control
  stream as in tests/node/test_fastlink.py: what a stage of a real swarm runs, less libp2p
  (which only carries the handshake, or the frames when no direct socket opens).

    .venv/bin/python benchmarks/count_hops.py      # prints the lists; writes results/hops.json
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio
import trio.testing

from swarm.model.generate import LocalModel
from swarm.net.channel import FramedChannel
from swarm.net.fastpath import accept_fastpath, open_direct_listener, open_fastpath
from swarm.node.compute.runtime import Compute
from swarm.node.ring.coordinator import Coordinator
from swarm.node.ring.fastlink import FrameLink
from swarm.node.ring.stage_worker import StageWorker
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.ring import run_memory_ring

ROOT = Path(__file__).resolve().parents[1]
SWARM = str(ROOT / "swarm")
WORKER = str(ROOT / "swarm" / "node" / "ring" / "stage_worker.py")
PROMPT = [5, 17, 99, 3]
# StageWorker methods that no hidden state passes through: ``serve``'s own handlers run once,
# when the inbound link closes (unwrapping the nursery's exception group, freeing sessions);
# what ``serve`` starts (the reader, the compute loop, the forwards) is counted
TEARDOWN = frozenset({"serve"})


def traced(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()`` with every swarm/ file entered on a stage's behalf recorded (module doc)."""
    seen: set[str] = set()

    def on_call(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(SWARM):
            return
        f = frame
        while f is not None:  # on a stage's behalf? (its innermost StageWorker frame)
            if f.f_code.co_filename == WORKER:
                if f.f_code.co_name not in TEARDOWN:
                    seen.add(str(Path(path).relative_to(ROOT)))
                return
            f = f.f_back

    threading.setprofile(on_call)
    sys.setprofile(on_call)
    try:
        out = run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return out, sorted(seen)


async def _fast_hop(name: str) -> tuple[FrameLink, FrameLink]:
    """Both ends of one hop over a real sealed loopback fast-path channel."""
    sa, sb = trio.testing.memory_stream_pair()
    ca = FramedChannel(sa, local_peer=f"{name}-up", remote_peer=f"{name}-down", timeout=30)
    cb = FramedChannel(sb, local_peer=f"{name}-down", remote_peer=f"{name}-up", timeout=30)
    out: dict[str, Any] = {}
    async with open_direct_listener() as listener:

        async def init() -> None:
            out["up"] = await open_fastpath(ca, timeout=30)

        async def resp() -> None:
            out["down"] = await accept_fastpath(cb, listener, timeout=30)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(init)
            nursery.start_soon(resp)
    assert out["up"].path == "direct", out["up"].path
    return FrameLink(out["up"]), FrameLink(out["down"])


async def _real_ring(model: LocalModel) -> Any:
    """The ring of ``run_memory_ring``, its hops fast-path channels (set up before tracing)."""
    n = len(model.stages)
    hops = [await _fast_hop(f"hop{i}") for i in range(n + 1)]
    coord = Coordinator(model.head, epoch=1, first_hop="stage0", chunk_timeout=30.0, compute=Compute())
    coord.attach(hops[0][0])
    workers = [StageWorker(st, epoch=1, upstream="up", is_tail=(i == n - 1), compute=Compute())
               for i, st in enumerate(model.stages)]  # fmt: skip
    async with trio.open_nursery() as nursery:
        for i, w in enumerate(workers):
            nursery.start_soon(w.serve, hops[i][1], hops[i + 1][0])
        nursery.start_soon(lambda: coord.serve_results(hops[n][1], tail_peer="tail"))
        res = await coord.generate(PROMPT, max_new_tokens=4, eos_token_ids=())
        nursery.cancel_scope.cancel()
    return res


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp), TinySpec(n_layers=6), seed=3)
        model = LocalModel.load(ckpt, stages=[(0, 2), (2, 4), (4, 6)], dtype=torch.float32)

        async def job(c: Any) -> Any:
            return await c.generate(PROMPT, max_new_tokens=4, eos_token_ids=())

        def memory() -> Any:
            (res,), _ = trio.run(lambda: run_memory_ring(model, [job]))
            return res

        mem_res, mem_files = traced(memory)
        real_res, real_files = traced(lambda: trio.run(_real_ring, model))
    for res in (mem_res, real_res):
        assert not isinstance(res, BaseException), res
    assert real_res.output_token_ids == mem_res.output_token_ids, (real_res, mem_res)

    def by_package(files: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in files:
            out[f.split("/")[1]] = out.get(f.split("/")[1], 0) + 1
        return out

    out = {
        "what": "swarm/ files a stage's code runs in while hidden states pass it (a 3-stage ring, 4 tokens)",
        "how": "sys/threading.setprofile: calls whose innermost StageWorker frame is one a hidden state passes (not serve's teardown when the inbound link closes) (benchmarks/count_hops.py)",
        "files": mem_files,
        "count": len(mem_files),
        "by_package": by_package(mem_files),
        "files_real_stack": real_files,
        "count_real_stack": len(real_files),
        "by_package_real_stack": by_package(real_files),
        "note": "count: the in-memory ring (memnet links); count_real_stack: traced on FrameLinks over "
        "sealed loopback fast-path channels; a file counts once however often it is entered; "
        "no timing, so machine load does not matter",
    }
    print(json.dumps(out, indent=2))
    (ROOT / "benchmarks" / "results" / "hops.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
