"""An in-memory network for fast tests of the ring: links with delay and failure, no sockets.

Frames are encoded to bytes and decoded again on the way through (with the real FrameDecoder and
its limits), so the codec is exercised exactly as over libp2p. A link can be given a one-way delay
(kept FIFO, as a TCP stream is), and cut: ``cut("kill")`` makes both ends see PeerLost at once (a
killed process closes its sockets); ``cut("freeze")`` delivers nothing more, so only timeouts
notice (a SIGSTOPped peer or a silently dropped link).
"""

from __future__ import annotations

import math

import trio

from swarm.errors import PeerLost, PeerTimeout
from swarm.proto.frame import Frame, FrameDecoder, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits


class MemLink:
    """One hop: ``send`` on the upstream side, ``receive`` on the downstream side."""

    def __init__(self, name: str, *, delay: float = 0.0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.name = name
        self.delay = delay
        self.limits = limits
        self._send, self._recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        self._decoder = FrameDecoder(limits)
        self._ready: list[Frame] = []
        self._state = "up"  # "up" | "kill" | "freeze"
        self.frames_sent = 0
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return f"MemLink({self.name}, delay={self.delay}, {self._state})"

    def cut(self, how: str = "kill") -> None:
        if how not in ("kill", "freeze"):
            raise ValueError(how)
        self._state = how
        if how == "kill":
            self._send.close()

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        if self._state == "kill":
            raise PeerLost(f"{self.name}: connection closed")
        if self._state == "freeze":
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await trio.sleep_forever()
            raise PeerTimeout(f"{self.name}: send timed out after {timeout} s")
        data = encode_frame(frame, self.limits)
        self.frames_sent += 1
        self.bytes_sent += len(data)
        self._send.send_nowait((trio.current_time() + self.delay, data))
        await trio.sleep(0)

    async def receive(self, timeout: float | None = None) -> Frame:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while not self._ready:
                if self._state == "freeze":
                    await trio.sleep_forever()
                try:
                    due, data = await self._recv.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    raise PeerLost(f"{self.name}: connection closed") from None
                if self._state == "freeze":
                    await trio.sleep_forever()
                wait = due - trio.current_time()
                if wait > 0:
                    await trio.sleep(wait)
                self._ready.extend(self._decoder.feed(data))
            return self._ready.pop(0)
        raise PeerTimeout(f"{self.name}: nothing received for {timeout} s")

    async def close(self) -> None:
        self._send.close()
