"""A member must not set the RTT others measure to it: the echoed clock is not trusted.

A's ctl link to a lying B over an in-memory stream with a 40 ms delay each way, on MockClock.
B rewrites every echo's clock (to say the beat took ~0 s, or 10 s), echoes beats A never sent,
and replays old echoes. A's RTT to B stays the real 80 ms.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarm.net.streams import TrioStreamRaw, open_framed
from swarm.node.members.heartbeat import Liveness, run_ctl_link
from swarm.proto.frame import Frame
from swarm.proto.messages import Heartbeat, parse_message

A, B = "peer-a", "peer-b"
DELAY = 0.040  # one way


@pytest.mark.parametrize("lie", ["zero", "ten-seconds", "made-up-beats", "replays"])
@pytest.mark.trio
async def test_an_echo_cannot_set_the_rtt(lie: str, autojump_clock: trio.testing.MockClock) -> None:
    liv = Liveness()
    left, right = trio.testing.memory_stream_pair()
    _, outbox = trio.open_memory_channel[Frame](8)

    async def side_a() -> None:
        async with open_framed(TrioStreamRaw(left), peer=B, protocol="ctl") as fs:
            await run_ctl_link(fs, liv, outbox, interval=0.5)

    async def liar() -> None:
        async with open_framed(TrioStreamRaw(right), peer=A, protocol="ctl") as fs:
            old: list[Frame] = []
            while True:
                frame = await fs.receive(timeout=30)
                beat = parse_message(frame)
                assert isinstance(beat, Heartbeat)
                await trio.sleep(2 * DELAY)  # the real round trip
                now_us = int(trio.current_time() * 1_000_000)
                if lie == "zero":
                    await fs.send(Heartbeat(beat.seq, now_us).to_frame())
                elif lie == "ten-seconds":
                    await fs.send(Heartbeat(beat.seq, max(0, now_us - 10_000_000)).to_frame())
                elif lie == "made-up-beats":
                    await fs.send(frame)
                    for n in range(1, 4):  # beats A has not sent (yet), stamped "now"
                        await fs.send(Heartbeat(beat.seq + 1000 * n, now_us).to_frame())
                else:
                    await fs.send(frame)
                    for f in old[-3:]:  # echoes A already heard
                        await fs.send(Heartbeat(parse_message(f).seq, now_us).to_frame())  # type: ignore[union-attr]
                    old.append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side_a)
        nursery.start_soon(liar)
        await trio.sleep(10.0)
        rtt = liv.rtt_ms(B)
        nursery.cancel_scope.cancel()
    assert rtt is not None and rtt == pytest.approx(2 * DELAY * 1000, abs=1.0), (lie, rtt)
