"""MessageIO: typed messages over anything that carries frames, the one place a message becomes a
frame and back (node/ never builds or parses a frame itself)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarm.errors import ProtocolError
from swarm.net.streams import TrioStreamRaw, open_framed
from swarm.node.ring.links import LocalLink
from swarm.proto import control as ctl
from swarm.proto.frame import DType, Frame, MsgType, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import Chunk, Heartbeat, Message, MessageIO, SessionEnd, expect_message
from swarm.testing.memnet import MemLink


class Recorder(MessageIO):
    """Frames in a list: what the typed methods hand to the frame-level ones, and back."""

    def __init__(self, peer: str = "P", limits: Limits = DEFAULT_LIMITS) -> None:
        self.peer, self.limits, self.frames = peer, limits, list[Frame]()

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        self.frames.append(frame)

    async def receive(self, timeout: float | None = None) -> Frame:
        return self.frames.pop(0)


def _messages() -> list[Message]:
    return [
        Heartbeat(7, 123),
        SessionEnd(5),
        ctl.Tokens((1, 2, 300), "abc"),
        ctl.Fail("busy", "later", 3),
        Chunk(9, 2, 0, "decode", DType.FP32, (1, 4), b"\0" * 16, 1, 0),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
async def test_a_message_goes_as_the_bytes_it_always_had(msg: Message) -> None:
    io = Recorder()
    await io.send_message(msg)
    assert encode_frame(io.frames[0], DEFAULT_LIMITS) == msg.encode()  # the wire is unchanged
    assert await io.receive_message() == msg


async def test_expect_names_the_peer_and_what_came_instead() -> None:
    io = Recorder(peer="QmUpstream")
    io.protocol = "/shard-swarm/ctl/1"
    await io.send_message(SessionEnd(5))
    with pytest.raises(ProtocolError, match=r"peer QmUpstream on /shard-swarm/ctl/1 sent SESSION_END where HEARTBEAT was expected"):
        await io.receive_message(expect=Heartbeat)
    await io.send_message(ctl.Ack())
    with pytest.raises(ProtocolError, match="sent CONTROL ack where CONTROL status_reply was expected"):
        await io.receive_message(expect=ctl.StatusReply)
    await io.send_message(ctl.Ack())
    assert isinstance(await io.receive_message(expect=ctl.Control), ctl.Ack)  # a base class: any op


async def test_a_malformed_frame_raises_its_own_error_with_the_peer() -> None:
    io = Recorder(peer="QmBad")
    await io.send(Frame(MsgType.HEARTBEAT, seq=1, meta={"t": 1, "junk": 2}))
    with pytest.raises(ProtocolError, match=r"^peer QmBad: HEARTBEAT field 'junk'") as info:
        await io.receive_message()
    assert type(info.value) is ProtocolError
    bad_frame = Frame(MsgType.HEARTBEAT, seq=1, session=3, meta={"t": 1})
    with pytest.raises(ProtocolError, match="QmBad"):
        expect_message(bad_frame, DEFAULT_LIMITS, Heartbeat, peer="QmBad")


async def test_request_message_sends_then_returns_the_reply() -> None:
    io = Recorder()
    got = await io.request_message(Heartbeat(1, 2), expect=Heartbeat)  # the recorder echoes
    assert got == Heartbeat(1, 2)


async def test_every_link_kind_carries_typed_messages() -> None:
    """MemLink (tests), LocalLink (one process) and FramedStream (libp2p and memnet streams)."""
    mem, local = MemLink("mem"), LocalLink("local")
    for link in (mem, local):
        await link.send_message(SessionEnd(4))
        assert await link.receive_message(expect=SessionEnd) == SessionEnd(4)
    assert mem.peer == "mem" and local.peer == "local"
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="p") as a, open_framed(
        TrioStreamRaw(right), peer="A", protocol="p"
    ) as b:
        await a.send_message(ctl.Tokens((5, 6), "xy"))
        assert await b.receive_message(expect=ctl.Tokens) == ctl.Tokens((5, 6), "xy")
        assert a.bytes_out == len(ctl.Tokens((5, 6), "xy").encode())
        await a.send_message(Heartbeat(1, 1))
        with pytest.raises(ProtocolError, match="peer A on p sent HEARTBEAT where CONTROL tokens was expected"):
            await b.receive_message(expect=ctl.Tokens)
