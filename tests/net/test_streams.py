"""FramedStream: frames over a byte stream, deadlines, exception mapping, a reader that drains."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

from swarm.errors import FrameError, PeerError, PeerLost, PeerTimeout
from swarm.net.streams import TrioStreamRaw, map_exception, open_framed
from swarm.proto.frame import DType, Frame, MsgType, encode_frame


def _hb(i: int) -> Frame:
    return Frame(MsgType.HEARTBEAT, seq=i, meta={"t": i})


def _chunk(i: int, nbytes: int) -> Frame:
    return Frame(MsgType.CHUNK, session=1, seq=i, dtype=DType.BF16, shape=(nbytes // 2,), meta={"pos": 0}, payload=b"\1" * nbytes)


async def test_frames_round_trip_both_ways() -> None:
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="p") as a, open_framed(
        TrioStreamRaw(right), peer="A", protocol="p"
    ) as b:
        await a.send(_hb(1))
        await a.send(_chunk(2, 4096))
        assert (await b.receive()).seq == 1
        got = await b.receive()
        assert got.payload == b"\1" * 4096 and got.shape == (2048,)
        await b.send(_hb(9))
        assert (await a.receive()).seq == 9
        assert a.bytes_out == b.bytes_in


async def test_request_gets_the_next_frame() -> None:
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="p") as a, open_framed(
        TrioStreamRaw(right), peer="A", protocol="p"
    ) as b, trio.open_nursery() as nursery:

        async def echo() -> None:
            f = await b.receive()
            await b.send(Frame(MsgType.HEARTBEAT, seq=f.seq + 100, meta={"t": 0}))

        nursery.start_soon(echo)
        assert (await a.request(_hb(5), timeout=5)).seq == 105


async def test_receive_times_out_on_a_silent_peer(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="ctl", io_timeout=3.0) as a:
        t0 = trio.current_time()
        with pytest.raises(PeerTimeout, match="peer B: nothing received on ctl for 3 s"):
            await a.receive()
        assert trio.current_time() - t0 == pytest.approx(3.0)


async def test_closed_peer_is_peer_lost_after_queued_frames() -> None:
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="ctl") as a:
        await right.send_all(encode_frame(_hb(1)))
        await right.aclose()
        assert (await a.receive()).seq == 1  # what arrived before EOF is still delivered
        with pytest.raises(PeerLost, match="peer B: closed its ctl stream"):
            await a.receive()


async def test_garbage_is_a_frame_error_naming_the_peer() -> None:
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="ctl") as a:
        await right.send_all(b"XX" + b"\0" * 40)
        with pytest.raises(FrameError, match="peer B on ctl: .*magic"):
            await a.receive()


async def test_eof_inside_a_frame_is_a_lost_stream_not_a_violation() -> None:
    """A peer killed mid-write looks exactly like this: the stream is lost (PeerLost), and the
    peer is not treated as one that broke the protocol (which gets it banned)."""
    left, right = trio.testing.memory_stream_pair()
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="ctl") as a:
        await right.send_all(encode_frame(_chunk(1, 1024))[:100])
        await right.aclose()
        with pytest.raises(PeerLost, match="ended mid-frame"):
            await a.receive()


async def test_reader_keeps_draining_while_the_consumer_is_busy() -> None:
    """With a lock-step pair a write completes only when the other side reads: the reader task
    takes 40 x 64 KiB while nobody calls receive() (py-libp2p resets streams whose reader stalls)."""
    left, right = trio.testing.lockstep_stream_pair()
    async with open_framed(TrioStreamRaw(right), peer="A", protocol="act") as b:
        with trio.fail_after(10):
            for i in range(40):
                await left.send_all(encode_frame(_chunk(i, 64 * 1024)))
        assert b.bytes_in >= 40 * 64 * 1024
        assert [(await b.receive()).seq for _ in range(40)] == list(range(40))


async def test_send_times_out_when_the_peer_never_reads(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.lockstep_stream_pair()  # nobody reads `right`
    async with open_framed(TrioStreamRaw(left), peer="B", protocol="act", io_timeout=2.0) as a:
        with pytest.raises(PeerTimeout, match="peer B: did not take .* bytes on act within 2 s"):
            await a.send(_chunk(1, 1024))


def test_foreign_exceptions_are_mapped_once() -> None:
    assert isinstance(map_exception(StreamEOF("x"), "P", "reading"), PeerLost)
    assert isinstance(map_exception(StreamReset("x"), "P", "reading"), PeerLost)
    assert isinstance(map_exception(trio.TooSlowError(), "P", "dialing"), PeerTimeout)
    assert isinstance(map_exception(ConnectionResetError(), "P", "writing"), PeerLost)
    other = map_exception(RuntimeError("boom"), "P", "x")
    assert type(other) is PeerError and "peer P" in str(other)
    mine = PeerTimeout("already ours")
    assert map_exception(mine, "P", "x") is mine


async def test_bad_timeout_is_refused() -> None:
    left, _ = trio.testing.memory_stream_pair()
    with pytest.raises(ValueError, match="io_timeout"):
        async with open_framed(TrioStreamRaw(left), peer="B", protocol="p", io_timeout=0):
            pass
