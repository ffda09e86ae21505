"""Links: the one interface the ring's data path is written against.

A link carries proto frames in FIFO order between two ends of one hop. Over the network it is a
``swarm.net.streams.FramedStream`` (libp2p) or a direct channel; inside one process (the
coordinator that is also a stage) it is :func:`local_link`; in fast tests it is
``swarm.testing.memnet``. Every ``receive`` and ``send`` takes a timeout: PeerTimeout when it
passes, PeerLost when the other end is gone.
"""

from __future__ import annotations

import math
from typing import Protocol, overload

import trio

from swarm.errors import PeerLost, PeerTimeout
from swarm.proto.frame import Frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import Message, MessageIO, Msg


class Link(Protocol):
    peer: str

    async def send(self, frame: Frame, timeout: float | None = None) -> None: ...

    async def receive(self, timeout: float | None = None) -> Frame: ...

    async def send_message(self, msg: Message, timeout: float | None = None) -> None: ...

    @overload
    async def receive_message(self, timeout: float | None = None, *, view: bool = False) -> Message: ...

    @overload
    async def receive_message(self, timeout: float | None = None, *, expect: type[Msg], view: bool = False) -> Msg: ...

    async def close(self) -> None: ...


class LocalLink(MessageIO):
    """Both ends of an in-process hop (frames are passed as objects, never copied)."""

    def __init__(self, name: str = "local", max_buffer: int = 1024, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.name = self.peer = name
        self.limits = limits
        self._send, self._recv = trio.open_memory_channel[Frame](max_buffer)

    def __repr__(self) -> str:
        return f"LocalLink({self.name})"

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                await self._send.send(frame)
        except trio.TooSlowError:
            raise PeerTimeout(f"{self.name}: send timed out") from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise PeerLost(f"{self.name}: closed") from None

    async def receive(self, timeout: float | None = None) -> Frame:
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                return await self._recv.receive()
        except trio.TooSlowError:
            raise PeerTimeout(f"{self.name}: nothing received for {timeout} s") from None
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise PeerLost(f"{self.name}: closed") from None

    async def close(self) -> None:
        await self._send.aclose()


def local_link(name: str = "local") -> LocalLink:
    return LocalLink(name)
