"""A gen/1 stream's messages, however long: sent as their frames, received whole.

A prompt or a receipt longer than one frame travels as PART frames first (swarm.proto.parts);
these two calls are the only way a generation's request and its replies cross a stream, so
every sender splits and every receiver joins. Each frame has the deadline ``timeout``.
"""

from __future__ import annotations

from typing import Any

from swarm.proto.control import Control
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import Message, parse_message
from swarm.proto.parts import Assembler, frames_of


async def send_message(fs: Any, msg: Control, *, timeout: float | None = None) -> None:
    for frame in frames_of(msg):
        await fs.send(frame, timeout=timeout)


async def receive_message(fs: Any, *, timeout: float | None = None, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The next whole message (its parts joined); ProtocolError for a bad one."""
    joined = Assembler()
    while True:
        msg = joined.feed(parse_message(await fs.receive(timeout=timeout), limits))
        if msg is not None:
            return msg
