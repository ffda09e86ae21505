"""Message channels: length-prefixed frames over a byte stream, every wait bounded.

A *message channel* moves whole messages (``bytes``) between two peers whose identities are
known (``local_peer`` / ``remote_peer``, base58 peer IDs). The fast path (fastpath.py) runs its
handshake over one and falls back to one when no direct socket can be opened.

Wire format (both :class:`FramedChannel` and the control stream of the fast path)::

    u32 big-endian length | payload

The length is checked against ``max_frame`` *before* anything is allocated. Every send and
receive runs under a deadline: a frozen peer raises :class:`PeerTimeout`, a vanished one
:class:`PeerLost`, a malformed frame :class:`FrameError` — each naming the peer.

:class:`Libp2pByteStream` adapts a py-libp2p ``INetStream`` (``read``/``write``/``close``)
to the small :class:`ByteStream` interface, translating libp2p's exceptions once, here.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Any, Protocol

import trio

from swarm.errors import FrameError, PeerLost, PeerTimeout
from swarm.net.streams import is_foreign_io_error, map_exception

DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
RECV_CHUNK = 256 * 1024

_LEN = struct.Struct(">I")


class ByteStream(Protocol):
    """The subset of ``trio.abc.Stream`` the channels need."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray: ...

    async def aclose(self) -> None: ...


class MessageChannel(Protocol):
    """Whole messages to and from one authenticated peer, each wait under a deadline."""

    local_peer: str
    remote_peer: str

    async def send(self, data: bytes, timeout: float | None = None) -> None: ...

    async def receive(self, timeout: float | None = None, *, max_len: int | None = None) -> bytes: ...

    async def aclose(self) -> None: ...


class FastLock:
    """A ``trio.Lock`` whose uncontended acquire does not pass through the scheduler.

    ``trio.Lock.acquire`` always yields once (a full scheduler pass: ~4 per ping-pong on the
    hot path). The socket operation under the lock checkpoints anyway, so skipping that yield
    keeps trio's cancellation guarantees where it matters and only loses a fairness point.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    def try_acquire(self) -> bool:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            return False
        return True

    async def acquire(self) -> None:
        if not self.try_acquire():
            await self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class BufferedReader:
    """Reads exact byte counts from a :class:`ByteStream`, keeping what it over-read.

    ``exactly(n)`` returns ``bytes``; data that arrived past the request stays in the buffer for
    the next call, so one large ``receive_some`` serves many small frames.
    """

    def __init__(self, stream: ByteStream, peer: str, initial: bytes = b"") -> None:
        self.stream = stream
        self.peer = peer
        self._buf = bytearray(initial)
        self._pos = 0

    @property
    def buffered(self) -> bytes:
        return bytes(self._buf[self._pos :])

    async def exactly(self, n: int) -> bytes:
        avail = len(self._buf) - self._pos
        if avail >= n:
            out = bytes(self._buf[self._pos : self._pos + n])
            self._pos += n
            return out
        # compact, then read until n bytes are there
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(RECV_CHUNK, n - len(self._buf)))
            if not chunk:
                raise PeerLost(
                    f"peer {self.peer} closed the connection "
                    f"({len(self._buf)} of {n} expected bytes received)"
                )
            self._buf += chunk
        if len(self._buf) == n:
            out = bytes(self._buf)
            self._buf.clear()
            return out
        out = bytes(self._buf[:n])
        self._pos = n
        return out


class SocketReader:
    """Like :class:`BufferedReader`, for a real (non-blocking) socket: reads into one buffer.

    No per-read allocation (``receive_some`` allocates its whole ``max_bytes`` each call), and
    bytes the kernel already holds are read without a trip through trio's scheduler
    (``os.readv`` first; ``wait_readable`` only on EAGAIN): trio's own ``recv_into`` yields
    once even when data is there. The caller bounds the wait with its own cancel scope.
    :meth:`view` returns a memoryview into the buffer, valid until the next call, so a caller
    that decrypts or copies out needs no intermediate ``bytes``. Cancel-safe: bytes received
    before a cancellation stay buffered for the next call.

    Large messages (over RECV_CHUNK, e.g. 1 MiB model bytes) are read exactly to their end, and
    so is the header after one: reading ahead into the next message's bytes left a partial
    message to be copied to the buffer's front before each large one (measured: 0.95 bytes
    copied per byte received when fetching model bytes over the fast path).
    """

    def __init__(self, sock: trio.socket.SocketType, peer: str, initial: bytes = b"") -> None:
        self.sock = sock
        self._fd = sock.fileno()
        self.peer = peer
        self._buf = bytearray(max(RECV_CHUNK, len(initial)))
        self._mv = memoryview(self._buf)
        self._buf[: len(initial)] = initial
        self._start = 0
        self._end = len(initial)
        self._exact = False  # the last message was large: read no further than each one's end

    def _take(self, n: int) -> memoryview:
        v = self._mv[self._start : self._start + n]
        self._start += n
        self._exact = n > RECV_CHUNK
        if self._start == self._end:
            self._start = self._end = 0
        return v

    async def view(self, n: int, *, just_polled: bool = False) -> memoryview:
        """``n`` bytes; ``just_polled``: a non-blocking read just came back empty, so wait for
        readability before reading again (saves a syscall on the ping-pong path)."""
        if self._end - self._start < n:
            if just_polled:
                await trio.lowlevel.wait_readable(self._fd)
            await self._fill(n)
        return self._take(n)

    def view_nowait(self, n: int) -> memoryview | None:
        """Like :meth:`view`, but None (consuming nothing) when ``n`` bytes are not there yet."""
        if self._end - self._start < n:
            self._make_room(n)
            while self._end - self._start < n:
                if not self._read_nowait(n):
                    return None
        return self._take(n)

    def _read_nowait(self, n: int) -> bool:
        """One non-blocking read; False when the kernel has nothing; PeerLost at EOF."""
        try:
            stop = self._start + n if self._exact or n > RECV_CHUNK else len(self._buf)
            got = os.readv(self._fd, [self._mv[self._end : stop]])
        except (BlockingIOError, InterruptedError):
            return False
        if not got:
            raise PeerLost(
                f"peer {self.peer} closed the connection "
                f"({self._end - self._start} of {n} expected bytes received)"
            )
        self._end += got
        return True

    async def exactly(self, n: int) -> bytes:
        return bytes(await self.view(n))

    def _make_room(self, n: int) -> None:
        have = self._end - self._start
        if self._start + n > len(self._buf):  # not enough room after start: compact or grow
            if n > len(self._buf):
                bigger = bytearray(max(n + RECV_CHUNK, 2 * len(self._buf)))  # never resize an exported buffer
                bigger[:have] = self._mv[self._start : self._end]
                self._buf, self._mv = bigger, memoryview(bigger)
            else:
                self._buf[:have] = bytes(self._mv[self._start : self._end])  # may overlap: copy
            self._start, self._end = 0, have

    async def _fill(self, n: int) -> None:
        self._make_room(n)
        while self._end - self._start < n:
            if not self._read_nowait(n):  # what is already there costs no scheduler pass
                await trio.lowlevel.wait_readable(self._fd)

    @property
    def buffered(self) -> bytes:
        return bytes(self._mv[self._start : self._end])


def write_nowait(fd: int, data: memoryview) -> int:
    """As much of ``data`` as a non-blocking socket takes right now (0 if none).

    An uncontended loopback send of a 64 KiB frame completes here, with no scheduler pass;
    the caller awaits ``stream.send_all`` for any remainder, under its cancel scope.
    """
    try:
        return os.write(fd, data)
    except (BlockingIOError, InterruptedError):
        return 0


class FramedChannel:
    """Length-prefixed messages over any :class:`ByteStream`.

    Used as the fast path's control channel (over a libp2p stream, whose Noise session
    authenticates ``remote_peer``) and as its fallback data path. Concurrent senders are
    serialised by a lock; one task at a time may receive.
    """

    def __init__(
        self,
        stream: ByteStream,
        *,
        local_peer: str,
        remote_peer: str,
        timeout: float = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.stream = stream
        self.local_peer = local_peer
        self.remote_peer = remote_peer
        self.timeout = timeout
        self.max_frame = max_frame
        self._reader = BufferedReader(stream, remote_peer)
        self._send_lock = FastLock()
        self._recv_lock = FastLock()
        self._pending_len: int | None = None  # header read, payload not yet (cancel-safe resume)
        self.closed = False

    def _deadline(self, timeout: float | None) -> float:
        return trio.current_time() + (self.timeout if timeout is None else timeout)

    async def send(self, data: bytes, timeout: float | None = None) -> None:
        if len(data) > self.max_frame:
            raise FrameError(
                f"refusing to send {len(data)} bytes to {self.remote_peer}: "
                f"over the frame cap of {self.max_frame}"
            )
        if self.closed:
            raise PeerLost(f"channel to {self.remote_peer} is closed")
        limit = self.timeout if timeout is None else timeout
        with trio.move_on_at(self._deadline(timeout)) as scope:
            async with self._send_lock:
                await self.stream.send_all(_LEN.pack(len(data)) + data)
        if scope.cancelled_caught:
            await self.aclose()
            raise PeerTimeout(
                f"sending {len(data)} bytes to {self.remote_peer} took over {limit} s"
            )

    async def receive(self, timeout: float | None = None, *, max_len: int | None = None) -> bytes:
        """One frame. ``max_len``: a smaller cap for this one (a handshake message), checked on
        the length prefix like ``max_frame``, before anything is buffered."""
        if self.closed:
            raise PeerLost(f"channel to {self.remote_peer} is closed")
        limit = self.timeout if timeout is None else timeout
        cap = self.max_frame if max_len is None else min(max_len, self.max_frame)
        with trio.move_on_at(self._deadline(timeout)) as scope:
            async with self._recv_lock:
                if self._pending_len is None:
                    (n,) = _LEN.unpack(await self._reader.exactly(4))
                    if n > cap:
                        await self.aclose()
                        raise FrameError(
                            f"peer {self.remote_peer} announced a {n}-byte frame, over the cap of {cap}"
                        )
                    self._pending_len = n
                data = await self._reader.exactly(self._pending_len) if self._pending_len else b""
                self._pending_len = None
                return data
        assert scope.cancelled_caught
        raise PeerTimeout(f"no message from {self.remote_peer} within {limit} s")

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self.stream.aclose()


class Libp2pByteStream:
    """Adapts a py-libp2p ``INetStream`` to :class:`ByteStream`.

    libp2p's exceptions are translated once, here, with streams.py's mapping: EOF becomes an
    empty read (the framing layer turns a mid-frame EOF into PeerLost), everything else
    PeerLost / PeerError naming the peer.
    """

    def __init__(self, stream: Any, peer: str) -> None:
        self.stream = stream
        self.peer = peer

    async def send_all(self, data: bytes) -> None:
        try:
            await self.stream.write(bytes(data))
        except Exception as exc:
            if is_foreign_io_error(exc):
                raise map_exception(exc, self.peer, "writing the fast-path stream") from exc
            raise

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data: bytes = await self.stream.read(max_bytes or RECV_CHUNK)
        except Exception as exc:
            if isinstance(exc, EOFError) or "EOF" in type(exc).__name__:
                return b""
            if is_foreign_io_error(exc):
                raise map_exception(exc, self.peer, "reading the fast-path stream") from exc
            raise
        return data

    async def aclose(self) -> None:
        with trio.move_on_after(1.0) as scope, contextlib.suppress(Exception):
            scope.shield = True
            await self.stream.close()
        if scope.cancelled_caught:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1.0),
                contextlib.suppress(Exception),
            ):
                await self.stream.reset()


def libp2p_channel(
    stream: Any,
    *,
    local_peer: str,
    timeout: float = DEFAULT_TIMEOUT,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> FramedChannel:
    """A :class:`FramedChannel` over a libp2p stream; the remote peer ID comes from Noise."""
    remote = str(stream.muxed_conn.peer_id)
    return FramedChannel(
        Libp2pByteStream(stream, remote),
        local_peer=local_peer,
        remote_peer=remote,
        timeout=timeout,
        max_frame=max_frame,
    )
