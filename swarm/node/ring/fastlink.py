"""A ring hop over a fast-path channel: proto frames in whole sealed messages.

``swarm.net.fastpath`` moves whole byte messages over a direct, AEAD-sealed TCP socket (or the
libp2p stream when no direct socket can be opened). Each message here is exactly one encoded
frame, decoded with the same limits as any other stream, so a hop is the same :class:`Link` to
the stage worker and the coordinator whichever path carries it.
"""

from __future__ import annotations

from typing import Any

from swarm.proto.frame import Frame, decode_frame, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import MessageIO


class FrameLink(MessageIO):
    opens_into = True  # a direct message opens straight into receive_view's ``into``

    def __init__(self, channel: Any, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.channel = channel
        self.limits = limits
        self.peer: str = channel.remote_peer

    def __repr__(self) -> str:
        return f"FrameLink({self.peer}, path={self.path})"

    @property
    def path(self) -> str:
        return str(self.channel.path)

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        await self.channel.send(encode_frame(frame, self.limits), timeout=timeout)

    async def send_encoded(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """An encoded frame as it lies (for a sender that built it in its own buffer: model
        bytes, swarm/node/compute/members.py); the buffer is free again once this returns."""
        await self.channel.send(data, timeout=timeout)

    async def receive(self, timeout: float | None = None, *, view: bool = False) -> Frame:
        """The next frame; ``view``: its payload a memoryview of the message, not a copy."""
        return decode_frame(await self.channel.receive(timeout=timeout), self.limits, view=view)

    async def receive_view(self, timeout: float | None = None, *, into: bytearray | None = None) -> Frame:
        """:meth:`receive` with the payload a memoryview of the opened message, not a copy (for
        a receiver that only hashes and writes it: model bytes, swarm/node/compute/rangepipe.py).
        ``into``: a buffer the caller owns, left alone until it is done with the frame; a
        direct-path message is opened straight into it (FastChannel.receive)."""
        if into is None:
            return await self.receive(timeout, view=True)
        return decode_frame(await self.channel.receive(timeout=timeout, into=into), self.limits, view=True)

    async def close(self) -> None:
        await self.channel.aclose()
