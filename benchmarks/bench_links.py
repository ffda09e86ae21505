"""What typed links cost a hop: ``send_message``/``receive_message`` against the frame calls they
wrap, alternated in one process.

    .venv/bin/python benchmarks/bench_links.py [--pairs 31] [--hops 300]

Issue 24 moved the message <-> frame step out of node/ into the links (``MessageIO``,
swarm/proto/messages.py). Per hop a hidden state now takes one more Python call each way (the
mixin's method around the link's own ``send``/``receive``) and an ``isinstance`` check. This
times one decode chunk's hop (a (1, 2048) bf16 hidden state, as a 1-token decode step of a
2048-wide model) both ways on the same link:

- frames: ``link.send(msg.to_frame())`` then ``parse_message(link.receive(), limits)`` (what
  node/ did before);
- typed: ``link.send_message(msg)`` then ``link.receive_message()`` (what it does now);

over the two in-process links: memnet's ``MemLink`` (encodes to bytes and decodes, as the
in-memory ring's hops do) and ``LocalLink`` (hands the frame over as an object). Each sample is
``--hops`` hops; the two ways run in turn (A B, then B A) so load falls on both sides of a pair,
and the figure is the median over pairs of typed CPU time / frames CPU time (this thread's,
``time.thread_time``: a core taken by another process does not count). Written to
benchmarks/results/links.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import trio

from swarm.node.ring.codec import hidden_chunk
from swarm.node.ring.links import LocalLink
from swarm.proto.limits import DEFAULT_LIMITS
from swarm.proto.messages import Chunk, parse_message
from swarm.testing.memnet import MemLink

HERE = Path(__file__).resolve().parents[1]
DIM = 2048


async def _frames(link: Any, msg: Chunk, hops: int) -> None:
    for _ in range(hops):
        await link.send(msg.to_frame())
        got = parse_message(await link.receive(), DEFAULT_LIMITS)
        assert isinstance(got, Chunk)


async def _typed(link: Any, msg: Chunk, hops: int) -> None:
    for _ in range(hops):
        await link.send_message(msg)
        got = await link.receive_message(expect=Chunk)
        assert isinstance(got, Chunk)


async def _timed(way: Callable[[Any, Chunk, int], Awaitable[None]], link: Any, msg: Chunk, hops: int) -> float:
    """CPU seconds of this thread (everything here runs on it), so the time spent waiting for a
    core on a loaded box does not count; the wall clock swung 0.6x-1.6x between pairs here."""
    t0 = time.thread_time()
    await way(link, msg, hops)
    return time.thread_time() - t0


async def measure(make: Callable[[], Any], pairs: int, hops: int) -> dict[str, Any]:
    link = make()
    msg = hidden_chunk(7, 1, 100, "decode", torch.randn(1, DIM).to(torch.bfloat16), epoch=3)
    for _ in range(3):  # warm-up
        await _timed(_frames, link, msg, hops)
        await _timed(_typed, link, msg, hops)
    ratios, frames_us, typed_us = [], [], []
    for i in range(pairs):
        order = [(_frames, frames_us), (_typed, typed_us)]
        if i % 2:
            order.reverse()
        took = {}
        for way, sink in order:
            t = await _timed(way, link, msg, hops)
            sink.append(t / hops * 1e6)
            took[way] = t
        ratios.append(took[_typed] / took[_frames])
    return {
        "typed_over_frames": round(statistics.median(ratios), 4),
        "pair_ratios_min_max": [round(min(ratios), 4), round(max(ratios), 4)],
        "frames_cpu_us_per_hop": round(statistics.median(frames_us), 2),
        "typed_cpu_us_per_hop": round(statistics.median(typed_us), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=31)
    p.add_argument("--hops", type=int, default=300)
    p.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "links.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    links: dict[str, Callable[[], Any]] = {"memlink": lambda: MemLink("bench"), "locallink": lambda: LocalLink("bench")}
    rows = {name: trio.run(measure, make, args.pairs, args.hops) for name, make in links.items()}
    out = {
        "what": "one decode chunk's hop, (1, 2048) bf16: typed send_message/receive_message ÷ send(to_frame()) + "
        "parse_message(receive()), CPU time of the one thread, alternated in one process (benchmarks/bench_links.py)",
        "pairs": args.pairs,
        "hops_per_sample": args.hops,
        "links": rows,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpu": os.cpu_count(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
