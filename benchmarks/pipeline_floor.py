"""The floor of a ring on this machine: the same blocks in separate processes, no swarm code.

A ring of processes pays two costs a single process does not: our software (links, framing,
thread hand-offs, the event loop) and the machine's (each stage's forward starts after its
process sat idle while the others computed, and on a shared CPU a forward after a pause runs
slower than the same forward back to back). This separates them: the coordinator's part
(embedding, final norm, LM head, greedy pick) and each block of layers run in their own
processes, passing the hidden state (raw bytes) round a ring of pipes, one token per traversal,
with one torch thread each, exactly the compute of the ring being measured. Nothing else runs:
no trio, no libp2p, no framing. ``floor ÷ local`` is what the machine allows a ring of these
blocks; ``ring ÷ floor`` is what our software costs.

    .venv/bin/python benchmarks/pipeline_floor.py --blocks 0:17,17:30 --tokens 48
    (bench_ring.py --only lan runs it with the plan its swarm chose)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from swarm.model.stage import Head, Stage
from swarm.model.weights import open_checkpoint


def _load(model_dir: Path, a: int, b: int, dtype: torch.dtype, quant: str, compiled: tuple[int, int] | None) -> Stage:
    """Block [a, b) with session 0 open; ``compiled``: (capacity, longest span) compiled and warmed
    as a ``--compile`` node's stage is (node/compute/runtime.py)."""
    ck = open_checkpoint(model_dir)
    stage = Stage.load(ck.args, ck.source, a, b, dtype=dtype, quant=quant)
    if compiled is not None:
        from swarm.model.compiled import warm_compiled

        stage.enable_compiled(*compiled)
        warm_compiled(stage)
    stage.open_session(0, compiled[0] if compiled else 4096)
    return stage


def _stage_proc(model_dir: str, a: int, b: int, dtype: str, ready: Any, inbox: Connection, outbox: Connection,
                quant: str = "none", compiled: tuple[int, int] | None = None) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    stage = _load(Path(model_dir), a, b, dt, quant, compiled)
    ready.put(a)
    while True:
        raw = inbox.recv_bytes()
        if raw == b"stop":
            outbox.send_bytes(raw)
            return
        h = torch.frombuffer(bytearray(raw), dtype=dt).reshape(-1, stage.args.dim)  # (T, D)
        outbox.send_bytes(stage.forward(0, h).contiguous().view(torch.uint8).numpy().tobytes())


def floor_tok_s(model_dir: Path, blocks: list[tuple[int, int]], ids: list[int], new_tokens: int, dtype: torch.dtype = torch.bfloat16,
                quant: str = "none", compiled: tuple[int, int] | None = None, head_block: tuple[int, int] | None = None,
                head_quant: str = "none") -> float:  # fmt: skip
    """Decode tok/s of the pipe ring (module doc), after the prompt's prefill. ``compiled``:
    (capacity, longest span) of compiled stages; ``head_block``: a block run in this process with
    the head, as a coordinator that holds a block runs it (not in ``blocks``); ``head_quant``: "int8"
    holds the LM head int8 (Head.hold_head_int8), as a quantized swarm's coordinator does."""
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    n = len(blocks)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n + 1)]  # pipes[i]: into stage i (pipes[n]: back to us)
    ready = ctx.Queue()
    procs = [
        ctx.Process(target=_stage_proc, args=(str(model_dir), a, b, str(dtype).removeprefix("torch."), ready, pipes[i][0], pipes[i + 1][1], quant, compiled),
                   daemon=True)
        for i, (a, b) in enumerate(blocks)
    ]
    for p in procs:
        p.start()
    ck = open_checkpoint(model_dir)
    dt = dtype
    head = Head.load(ck.args, ck.source, dtype=dt)
    if head_quant == "int8":
        head.hold_head_int8()
    own = _load(model_dir, *head_block, dt, quant, compiled) if head_block else None
    try:
        for _ in range(n):
            ready.get(timeout=600)  # every block loaded
        first_in, last_out = pipes[0][1], pipes[n][0]

        def traverse(tokens: list[int]) -> int:
            with torch.inference_mode():
                h = head.embed(torch.tensor(tokens))  # (T, D)
                if own is not None:
                    h = own.forward(0, h)
                first_in.send_bytes(h.contiguous().view(torch.uint8).numpy().tobytes())
                out = torch.frombuffer(bytearray(last_out.recv_bytes()), dtype=dt).reshape(-1, ck.args.dim)
                return int(head.logits(out[-1:]).argmax(-1)[0])

        tok = traverse(ids)
        times = []
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            tok = traverse([tok])
            times.append(time.perf_counter() - t0)
        return 1.0 / statistics.median(times)
    finally:
        pipes[0][1].send_bytes(b"stop")  # passed on round the ring
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> None:
    from swarm.model.bundled import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="0:17,17:30")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a = ap.parse_args()
    blocks = [(int(x), int(y)) for x, y in (b.split(":") for b in a.blocks.split(","))]
    ids = list(range(100, 141))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    print(f"pipe ring {blocks}: {floor_tok_s(default_model_dir(), blocks, ids, a.tokens, dtype):.2f} decode tok/s")


if __name__ == "__main__":
    main()
