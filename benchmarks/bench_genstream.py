"""What the one reader of a generation's stream costs (swarm/node/generation/genstream.py).

Every client of a generation (the CLI, the API, a relaying node) now reads its stream with
``GenStream``: per frame, a deadline scope, the timeout rule and the dispatch to a sink. This
measures that cost against the floor any reader pays: a bare loop of ``receive_message`` with the
same dispatch (what the three readers it replaced did, less their timeout bookkeeping). Both read
the same stream, FRAMES one-token ``tokens`` frames and a receipt, over the in-memory network (the
real frame codec, no sockets, so the reader's own cost is not hidden by a network's); the two are
alternated ROUNDS times in one run, and the median of the per-round ratios is reported.

    .venv/bin/python benchmarks/bench_genstream.py   # prints the ratio; writes results/genstream.json
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from swarm.node.generation.genstream import GenStream
from swarm.node.generation.genwire import receive_message, send_message
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_GEN
from swarm.testing.memnet import MemNet

FRAMES = 2000
ROUNDS = 9
OUT = Path(__file__).parent / "results" / "genstream.json"


class Sink:
    def __init__(self) -> None:
        self.n = 0

    async def tokens(self, ids: list[int], text: str) -> None:
        self.n += len(ids)

    async def notice(self, text: str) -> None:
        return None

    async def progress(self, done: int, total: int) -> None:
        return None


async def floor(fs: Any, peer: str, sink: Sink) -> dict[str, Any]:
    while True:
        msg = await receive_message(fs, timeout=60)
        if isinstance(msg, ctl.Tokens):
            await sink.tokens(list(msg.ids), msg.text)
        elif isinstance(msg, ctl.Notice):
            await sink.notice(msg.text)
        elif isinstance(msg, ctl.Done):
            return dict(msg.receipt)
        else:
            raise RuntimeError(msg)


async def genstream(fs: Any, peer: str, sink: Sink) -> dict[str, Any]:
    return await GenStream(fs, peer, idle_s=60).read(sink)


async def main() -> dict[str, Any]:
    net = MemNet(delay=0.0)
    secret, swarm = b"s" * 32, "0123456789abcdef0123456789abcdef"
    times: dict[str, list[float]] = {"floor": [], "genstream": []}
    async with (
        net.open_host(b"\x01" * 32, secret=secret, swarm_id=swarm) as server,
        net.open_host(b"\x02" * 32, secret=secret, swarm_id=swarm) as me,
    ):

        async def serve(peer: str, fs: Any) -> None:
            await fs.receive(timeout=10)
            for i in range(FRAMES):
                await fs.send(ctl.Tokens((i % 1000,), "x").to_frame())
            await send_message(fs, ctl.Done({"output_token_ids": []}))

        server.handle(PROTO_GEN, serve)
        peer = await me.dial(server.addrs()[0])
        for r in range(ROUNDS):
            order = [("floor", floor), ("genstream", genstream)]
            for name, reader in order if r % 2 == 0 else order[::-1]:
                async with me.open_stream(peer, PROTO_GEN, timeout=5) as fs:
                    await send_message(fs, ctl.Gen.checked([1], max_new_tokens=1))
                    sink = Sink()
                    t0 = time.perf_counter()
                    await reader(fs, peer, sink)
                    times[name].append(time.perf_counter() - t0)
                    assert sink.n == FRAMES
    ratios = [g / f for f, g in zip(times["floor"], times["genstream"], strict=True)]
    return {
        "what": "time to read a gen stream of one-token frames: genstream.GenStream.read / a bare receive_message loop",
        "frames": FRAMES,
        "rounds": ROUNDS,
        "median_ratio": round(statistics.median(ratios), 3),
        "ratios": [round(x, 3) for x in ratios],
        "floor_us_per_frame": round(statistics.median(times["floor"]) / FRAMES * 1e6, 1),
        "genstream_us_per_frame": round(statistics.median(times["genstream"]) / FRAMES * 1e6, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    result = trio.run(main)
    print(json.dumps(result, indent=2))
    OUT.write_text(json.dumps(result, indent=2) + "\n")
