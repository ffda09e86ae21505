"""SocketReader (swarm/net/channel.py) on a real socket pair: large messages are read exactly
to their end, so nothing of the next one is read ahead and then copied to the buffer's front."""

from __future__ import annotations

import os

import trio

from swarm.net.channel import RECV_CHUNK, SocketReader


async def test_large_messages_are_read_to_their_end_and_no_further() -> None:
    a, b = trio.socket.socketpair()
    big = [os.urandom(3 * RECV_CHUNK + 7), os.urandom(5 * RECV_CHUNK + 1)]
    msgs = [b"h1" * 6, big[0], b"h2" * 6, big[1], b"tail"]
    with a, b:
        reader = SocketReader(b, "peer")

        async def send() -> None:
            for m in msgs:
                view = memoryview(m)
                while view:
                    view = view[await a.send(view) :]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            for m in msgs:
                with trio.fail_after(30):
                    got = bytes(await reader.view(len(m)))
                assert got == m
                if len(m) > RECV_CHUNK:  # nothing of the next message was read: nothing to move
                    assert reader._end == reader._start == 0
