"""Framed streams: swarm.proto frames over one py-libp2p stream, every wait bounded.

Theory of operation
-------------------
A :class:`FramedStream` pumps bytes between a libp2p ``INetStream`` and the sans-IO
:class:`~swarm.proto.frame.FrameDecoder`. Two py-libp2p traps shape it:

* A frozen peer (SIGSTOP) makes ``stream.read()`` hang forever, so callers never read the raw
  stream: a *reader task* does, and :meth:`FramedStream.receive` waits on the decoded-frame queue
  under a deadline (:class:`~swarm.errors.PeerTimeout` when it passes). Writes run under
  ``trio.fail_after`` too.
* A receiver that stops reading for > 5 s with ~4 MiB in flight gets its stream reset by the
  sender's yamux (hard-coded). The reader task keeps draining the socket into the queue whatever
  the consumer is doing; only when ``max_queued`` whole frames are waiting does it pause.

Exceptions are translated once, here (and in host.py): EOF / reset / closed / socket errors become
:class:`~swarm.errors.PeerLost`, deadlines :class:`~swarm.errors.PeerTimeout`, bytes that break
the wire protocol :class:`~swarm.errors.FrameError` (a ProtocolError). Code above ``net/`` never
sees a libp2p exception. A killed peer shows up as a clean EOF, exactly like a normal close.

Lifetime: ``async with open_framed(raw, peer=..., protocol=...) as fs`` starts the reader in its
own nursery and, on exit, cancels it and closes the stream (reset if closing does not finish in
time). One stream, one ``FramedStream``; writes are serialised by a lock so concurrent senders
never interleave frame bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import trio

from swarm.errors import FrameError, PeerError, PeerLost, PeerTimeout, SwarmError
from swarm.proto.frame import Frame, FrameDecoder, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import MessageIO

log = logging.getLogger("swarm.net.streams")

DEFAULT_IO_TIMEOUT = 10.0  # seconds for one receive() or send() unless the caller says otherwise
CLOSE_TIMEOUT = 1.0
READ_CHUNK = 256 * 1024
DEFAULT_MAX_QUEUED = 64  # decoded frames waiting for the consumer before the reader pauses


def map_exception(exc: BaseException, peer: str, doing: str) -> SwarmError:
    """Translate a foreign (libp2p, socket, trio) exception into this project's error tree.

    ``peer`` is the remote peer ID, ``doing`` a short phrase ("reading ctl", "dialing"). Our own
    errors pass through unchanged.
    """
    if isinstance(exc, SwarmError):
        return exc
    if isinstance(exc, trio.TooSlowError):
        return PeerTimeout(f"peer {peer}: timed out {doing}")
    name = type(exc).__name__
    if isinstance(exc, EOFError) or "EOF" in name:
        return PeerLost(f"peer {peer}: stream closed while {doing}")
    if "Reset" in name:
        return PeerLost(f"peer {peer}: stream reset while {doing}")
    if isinstance(exc, OSError | trio.BrokenResourceError | trio.ClosedResourceError) or "Closed" in name:
        return PeerLost(f"peer {peer}: connection gone while {doing} ({name})")
    return PeerError(f"peer {peer}: {doing} failed: {name}: {str(exc)[:200]}")


def is_foreign_io_error(exc: BaseException) -> bool:
    """True for exceptions map_exception() should translate (libp2p errors, socket errors)."""
    if isinstance(exc, SwarmError | trio.Cancelled | KeyboardInterrupt):
        return False
    mod = type(exc).__module__ or ""
    return (
        mod.startswith(("libp2p", "multiaddr"))
        or isinstance(
            exc, OSError | EOFError | trio.TooSlowError | trio.BrokenResourceError | trio.ClosedResourceError
        )
    )


class FramedStream(MessageIO):
    """Frames to and from one peer over one libp2p stream, and the typed messages they carry
    (``send_message``/``receive_message``, :class:`~swarm.proto.messages.MessageIO`). Build with
    :func:`open_framed`."""

    def __init__(
        self,
        raw: Any,
        *,
        peer: str,
        protocol: str,
        limits: Limits = DEFAULT_LIMITS,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.raw = raw
        self.peer = peer
        self.protocol = protocol
        self.limits = limits
        self.io_timeout = io_timeout
        self._decoder = FrameDecoder(limits)
        self._send_q, self._recv_q = trio.open_memory_channel[Frame](max_queued)
        self._write_lock = trio.Lock()
        self._end: SwarmError | None = None  # why the reader stopped, raised once the queue drains
        self.bytes_in = 0
        self.bytes_out = 0

    def __repr__(self) -> str:
        return f"FramedStream(peer={self.peer}, protocol={self.protocol})"

    # -- the reader task ---------------------------------------------------------------------

    async def _reader(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                try:
                    data = await self.raw.read(READ_CHUNK)
                except BaseException as exc:
                    if not is_foreign_io_error(exc):
                        raise
                    self._end = map_exception(exc, self.peer, f"reading {self.protocol}")
                    return
                if not data:
                    try:
                        self._decoder.eof()
                    except FrameError as exc:
                        # cut off mid-frame: a crashed peer looks exactly like this, so it is a
                        # lost stream, not a protocol violation (which would get the peer banned)
                        self._end = PeerLost(f"peer {self.peer}: {self.protocol} stream ended mid-frame ({exc})")
                    else:
                        self._end = PeerLost(f"peer {self.peer}: closed its {self.protocol} stream")
                    return
                self.bytes_in += len(data)
                try:
                    frames = self._decoder.feed(data)
                except FrameError as exc:
                    self._end = FrameError(f"peer {self.peer} on {self.protocol}: {exc}")
                    log.warning("peer %s broke the wire protocol on %s: %s", self.peer, self.protocol, exc)
                    return
                for frame in frames:
                    await self._send_q.send(frame)
        finally:
            if self._end is None:
                self._end = PeerLost(f"peer {self.peer}: {self.protocol} stream closed locally")
            self._send_q.close()

    # -- public API --------------------------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Frame:
        """The next frame; PeerTimeout after ``timeout`` (default io_timeout) seconds of silence,
        PeerLost once the stream has ended, FrameError if the peer broke the protocol."""
        limit = self.io_timeout if timeout is None else timeout
        with trio.move_on_after(limit):
            try:
                return await self._recv_q.receive()
            except trio.EndOfChannel:
                assert self._end is not None
                raise self._end from None
            except trio.ClosedResourceError:
                raise PeerLost(f"peer {self.peer}: {self.protocol} stream already closed") from None
        raise PeerTimeout(f"peer {self.peer}: nothing received on {self.protocol} for {limit:g} s")

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        """Encode and write one frame; PeerTimeout if the peer does not take it in time."""
        data = encode_frame(frame, self.limits)
        limit = self.io_timeout if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                async with self._write_lock:
                    await self.raw.write(data)
        except BaseException as exc:
            if isinstance(exc, trio.TooSlowError):
                raise PeerTimeout(
                    f"peer {self.peer}: did not take {len(data)} bytes on {self.protocol} within {limit:g} s"
                ) from None
            if is_foreign_io_error(exc):
                raise map_exception(exc, self.peer, f"writing {self.protocol}") from None
            raise
        self.bytes_out += len(data)

    async def request(self, frame: Frame, timeout: float | None = None) -> Frame:
        """Send ``frame`` and return the next frame received (one deadline for both)."""
        limit = self.io_timeout if timeout is None else timeout
        deadline = trio.current_time() + limit
        await self.send(frame, timeout=limit)
        return await self.receive(timeout=max(0.0, deadline - trio.current_time()))

    async def close(self) -> None:
        """Half-close politely (the peer sees EOF); reset if that does not finish quickly."""
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(CLOSE_TIMEOUT) as scope,
            contextlib.suppress(Exception),
        ):
            await self.raw.close()
        if scope.cancelled_caught:
            await self.reset()

    async def reset(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT), contextlib.suppress(Exception):
            await self.raw.reset()


@contextlib.asynccontextmanager
async def open_framed(
    raw: Any,
    *,
    peer: str,
    protocol: str,
    limits: Limits = DEFAULT_LIMITS,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    max_queued: int = DEFAULT_MAX_QUEUED,
) -> AsyncIterator[FramedStream]:
    """Wrap a raw libp2p stream; its reader task lives exactly as long as the ``async with``."""
    if not (io_timeout > 0 and math.isfinite(io_timeout)):
        raise ValueError(f"io_timeout must be a positive finite number of seconds, got {io_timeout!r}")
    fs = FramedStream(raw, peer=peer, protocol=protocol, limits=limits, io_timeout=io_timeout, max_queued=max_queued)
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(fs._reader)
        try:
            yield fs
        except Exception as exc:  # re-raised below, bare, not wrapped in an ExceptionGroup
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
            await fs.close()
    if failure is not None:
        raise failure


class TrioStreamRaw:
    """Adapts a ``trio.abc.Stream`` (a TCP socket, an in-memory test pair) to the raw stream
    interface :class:`FramedStream` pumps (``read``/``write``/``close``/``reset``)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def read(self, n: int = READ_CHUNK) -> bytes:
        return bytes(await self.stream.receive_some(n))

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()

    async def reset(self) -> None:
        await trio.aclose_forcefully(self.stream)
