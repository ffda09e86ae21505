"""A ring hop over the fast path (node/ring/fastlink.py): proto frames through a real sealed
loopback TCP channel (swarm/net/fastpath.py), one whole encoded frame per message, decoded with
the hop's limits. The control channel that negotiates it is an in-memory stream pair standing in
for the libp2p stream, as in tests/net/test_fastpath.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trio
import trio.testing

from swarm.errors import FrameError, PeerLost
from swarm.net.channel import FramedChannel
from swarm.net.direct import FastChannel
from swarm.net.fastpath import accept_fastpath, open_direct_listener, open_fastpath
from swarm.node.ring.codec import hidden_chunk
from swarm.node.ring.fastlink import FrameLink
from swarm.proto.frame import Frame, MsgType
from swarm.proto.limits import DEFAULT_LIMITS

ALICE, BOB = "12D3KooWAlice", "12D3KooWBob"


async def _channels() -> tuple[FastChannel, FastChannel]:
    sa, sb = trio.testing.memory_stream_pair()
    ca = FramedChannel(sa, local_peer=ALICE, remote_peer=BOB, timeout=5)
    cb = FramedChannel(sb, local_peer=BOB, remote_peer=ALICE, timeout=5)
    out: dict[str, FastChannel] = {}
    async with open_direct_listener() as listener:

        async def init() -> None:
            out["a"] = await open_fastpath(ca, timeout=5)

        async def resp() -> None:
            out["b"] = await accept_fastpath(cb, listener, timeout=5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(init)
            nursery.start_soon(resp)
    return out["a"], out["b"]


async def test_frames_cross_a_direct_hop_whole_and_in_order() -> None:
    a, b = await _channels()
    up, down = FrameLink(a), FrameLink(b)
    assert (up.peer, down.peer, up.path, down.path) == (BOB, ALICE, "direct", "direct")
    assert repr(up) == "FrameLink(12D3KooWBob, path=direct)"
    chunks = [hidden_chunk(1, i, i, "decode", torch.randn(1, 64), epoch=2).to_frame() for i in range(5)]
    for f in chunks:  # small frames: the socket buffers hold them all
        await up.send(f, timeout=5)
    assert [await down.receive(timeout=5) for _ in chunks] == chunks
    await down.send(Frame(MsgType.SESSION_END, session=1), timeout=5)
    assert (await up.receive(timeout=5)).msg_type == MsgType.SESSION_END
    await up.close()
    with pytest.raises(PeerLost):
        await down.receive(timeout=5)


async def test_a_frame_over_the_hops_limits_is_refused_on_arrival() -> None:
    a, b = await _channels()
    small = dataclasses.replace(DEFAULT_LIMITS, max_elements=32)
    up, down = FrameLink(a), FrameLink(b, limits=small)
    await up.send(hidden_chunk(1, 1, 0, "decode", torch.zeros(1, 64), epoch=0).to_frame(), timeout=5)
    with pytest.raises(FrameError):
        await down.receive(timeout=5)
    await up.close()
