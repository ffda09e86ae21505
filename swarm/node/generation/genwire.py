"""A gen/1 stream's messages, however long: sent in pieces, received whole.

A prompt or a receipt longer than one frame travels as Part messages first (swarm.proto.parts);
these two calls are the only way a generation's request and its replies cross a stream, so
every sender splits and every receiver joins. Each piece has the deadline ``timeout``.
"""

from __future__ import annotations

from swarm.node.hosting import Stream
from swarm.proto.control import Control
from swarm.proto.messages import Message
from swarm.proto.parts import Assembler, pieces_of


async def send_message(fs: Stream, msg: Control, *, timeout: float | None = None) -> None:
    for piece in pieces_of(msg):
        await fs.send_message(piece, timeout=timeout)


async def receive_message(fs: Stream, *, timeout: float | None = None) -> Message:
    """The next whole message (its parts joined); ProtocolError for a bad one."""
    joined = Assembler()
    while True:
        msg = joined.feed(await fs.receive_message(timeout=timeout))
        if msg is not None:
            return msg
