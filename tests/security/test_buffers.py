"""What a client-invite holder can make a node hold (issue 27, finding 3).

A client may open generations (``/shard-swarm/gen/1``). Before the fix each of its streams could
hold a partial frame up to the 32 MiB frame cap until a 20 s deadline: 10 streams took a node
from 352 to 689 MiB, and 256 streams per identity were allowed. Now a client's frames are capped
at 384 KiB (every valid prompt frame fits: 64 Ki token ids and 64 KiB of metadata; a tensor
does not), at most four
wait for the handler, its yamux windows never grow past 256 KiB, and a client identity holds at
most 8 streams (64 for every client together), every protocol counted, identify included.

Against the shared 3-process swarm: a client-invite holder opens 10 ``gen/1`` streams, each
pushing 24 MiB of a frame that announces 28 MiB; the node's RSS, sampled throughout, grows by at
most 3 MiB per stream. Another opens 12 silent ``gen/1`` streams: the node refuses past 8. An
honest generation still equals the reference.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.proto.admission import CLIENT, client_secret, member_key
from swarm.proto.frame import DType, Frame, MsgType, encode_frame
from swarm.proto.limits import PROTO_GEN

from .swarmkit import LiveSwarm, assert_still_serving

pytestmark = pytest.mark.slow

MiB = 1024 * 1024
STREAMS = 10


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _as_client(ls: LiveSwarm, node: int):  # type: ignore[no-untyped-def]
    sw = ls.swarm
    return client.open_client(sw.addrs[node], secret=client_secret(sw.secret), swarm_id=sw.swarm_id, role=CLIENT,
                              member_key=member_key(sw.secret))  # fmt: skip


async def test_a_client_cannot_make_a_node_hold_big_frames_or_many_streams(live: LiveSwarm) -> None:
    sw = live.swarm
    node = 2
    pid = sw.procs[node].pid
    n = 7 * MiB  # int32 ids: a 28 MiB frame
    big = encode_frame(Frame(MsgType.CONTROL, dtype=DType.INT32, shape=(n,), meta={"op": "gen", "body": {}},
                             payload=bytes(4 * n)))  # fmt: skip
    before = rss_bytes(pid)
    peak = before
    pushed = 0

    async def push(h, peer: str) -> None:  # type: ignore[no-untyped-def]
        nonlocal pushed
        with contextlib.suppress(Exception):  # the node may cut it off: that is the point
            async with h.open_stream(peer, PROTO_GEN, timeout=10) as fs:
                for off in range(0, 24 * MiB, 256 * 1024):
                    await fs.raw.write(big[off : off + 256 * 1024])
                    pushed += 256 * 1024
                await trio.sleep(6)  # hold it, partial, as long as the node lets us

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_bytes(pid))
            await trio.sleep(0.1)

    async with _as_client(live, node) as (h, peer), trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        with trio.move_on_after(25):
            async with trio.open_nursery() as pushers:
                for _ in range(STREAMS):
                    pushers.start_soon(push, h, peer)
        peak = max(peak, rss_bytes(pid))
        nursery.cancel_scope.cancel()
    grew = peak - before
    assert grew <= 3 * MiB * STREAMS, f"node RSS grew {grew / MiB:.1f} MiB for {STREAMS} client streams"
    assert "over max_frame_bytes=393216" in sw.log(node), "the node never judged the client's frames"

    async with _as_client(live, node) as (h, peer):
        streams = contextlib.AsyncExitStack()
        async with streams:
            for _ in range(12):
                with contextlib.suppress(Exception):
                    await streams.enter_async_context(h.open_stream(peer, PROTO_GEN, timeout=10))
            await trio.sleep(1.0)
    assert "8 streams open (a client's limit)" in sw.log(node)
    await assert_still_serving(live)
    print(f"RSS grew {grew / MiB:.1f} MiB for {STREAMS} streams; the client pushed {pushed / MiB:.1f} MiB")


def test_the_client_frame_cap_admits_every_valid_prompt_frame() -> None:
    """The frames of the longest prompt a gen request may carry (ids and text both at their per-frame
    maximum, text of 4-byte characters) with the most metadata a frame may hold still fit a client's
    frame cap: an honest client is never banned for a long prompt."""
    from swarm.net.host import CLIENT_FRAME_BYTES
    from swarm.proto.control import IDS_PER_FRAME, TEXT_PER_FRAME, Gen
    from swarm.proto.limits import DEFAULT_LIMITS
    from swarm.proto.parts import frames_of

    gen = Gen(ids=tuple(range(3 * IDS_PER_FRAME + 5)), text="\U0001f600" * (3 * TEXT_PER_FRAME + 5))
    sizes = [len(encode_frame(f)) for f in frames_of(gen)]
    assert len(sizes) == 4  # three PART frames, then the request with the rest
    assert max(sizes) >= 4 * IDS_PER_FRAME + 4 * TEXT_PER_FRAME  # full pieces, not a split that hid them
    biggest = encode_frame(Frame(MsgType.CONTROL, dtype=DType.INT32, shape=(IDS_PER_FRAME,), payload=bytes(4 * IDS_PER_FRAME),
                                 meta={"op": "gen", "body": {"x": ["y" * 4000] * 16}}))  # fmt: skip
    assert len(biggest) > 4 * IDS_PER_FRAME + DEFAULT_LIMITS.max_meta_bytes - 2048  # near the most metadata may hold
    assert max(*sizes, len(biggest)) <= CLIENT_FRAME_BYTES < 32 * MiB
