"""Files one hidden state passes through at a stage (issue 24's "file hops per stage").

How it counts: a 3-stage in-memory ring (``swarm.testing.ring``) of a tiny checkpoint decodes a
few tokens while ``sys.setprofile``/``threading.setprofile`` record every Python call made on a
stage's behalf: every call whose stack holds a ``StageWorker`` method (its reader, its compute
loop, its forward in a worker thread), from the inbound link's ``receive`` to the outbound
link's ``send``. A file counts once per stage however often it is entered. Files outside
swarm/ (torch, trio, transformers) are not counted; the in-memory link (swarm/testing/memnet.py)
stands where a real hop has ring/fastlink.py and net/fastpath.py (listed separately: swap one
for two to get the real stack's figure, which is counted, not traced).

    .venv/bin/python benchmarks/count_hops.py      # prints the lists; writes results/hops.json
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import trio

from swarm.model.generate import LocalModel
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.ring import run_memory_ring

ROOT = Path(__file__).resolve().parents[1]
SWARM = str(ROOT / "swarm")
WORKER = str(ROOT / "swarm" / "node" / "ring" / "stage_worker.py")


def main() -> None:
    torch.set_num_threads(1)
    seen: set[str] = set()

    def on_call(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(SWARM):
            return
        f = frame
        while f is not None:  # on a stage's behalf?
            if f.f_code.co_filename == WORKER:
                seen.add(str(Path(path).relative_to(ROOT)))
                return
            f = f.f_back

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp), TinySpec(n_layers=6), seed=3)
        model = LocalModel.load(ckpt, stages=[(0, 2), (2, 4), (4, 6)], dtype=torch.float32)

        async def job(c: Any) -> Any:
            return await c.generate([5, 17, 99, 3], max_new_tokens=4, eos_token_ids=())

        threading.setprofile(on_call)
        sys.setprofile(on_call)
        try:
            (res,), _ = trio.run(lambda: run_memory_ring(model, [job]))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    assert not isinstance(res, BaseException), res
    files = sorted(seen)
    real_link = ["swarm/node/ring/fastlink.py", "swarm/net/fastpath.py"]
    by_package: dict[str, list[str]] = {}
    for f in files:
        by_package.setdefault(f.split("/")[1], []).append(f)
    out = {
        "what": "swarm/ files a stage's code runs in while hidden states pass it (in-memory ring, 3 stages)",
        "how": "sys/threading.setprofile: calls whose stack holds a StageWorker method (benchmarks/count_hops.py)",
        "files": files,
        "count": len(files),
        "by_package": {k: len(v) for k, v in by_package.items()},
        "count_real_stack": len(files) - ("swarm/testing/memnet.py" in seen) + len(real_link),
        "real_stack_link_files": real_link,
        "note": "a file counts once however often it is entered; no timing, so machine load does not matter",
    }
    print(json.dumps(out, indent=2))
    (ROOT / "benchmarks" / "results" / "hops.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
