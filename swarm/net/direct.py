"""The fast path's data plane: sealed, counted frames over one direct TCP socket, and the
channel that hides whether data goes that way or over the libp2p stream.

Theory of operation
-------------------
The handshake that agrees on the keys and proves the socket lives in fastpath.py (steps 1, 2, 4
there); this module is what runs after it.

3. Direct frames: ``u32 length | u64 counter | AEAD(payload)`` with the 12-byte header as
   associated data and the nonce derived from the counter. Counters start at 0 per direction and
   never repeat (separate keys per direction, counter bumped under the send lock); the receiver
   requires exactly the next counter, so a replay or reorder is caught before decryption and a
   flipped byte fails the tag. Either closes the channel with a ProtocolError naming the peer.
   The length is capped before anything is allocated.
5. Hot path (benchmarks/bench_transport.py): sealing goes straight into a reused send buffer
   behind its header, and the frame leaves in one ``os.write`` on the non-blocking socket; only
   when the kernel will not take it all does a cancel scope open around trio's ``send_all``.
   Receiving first tries a non-blocking read of a whole frame; only when it is not there yet does
   a cancel scope open around the wait. Locks are taken without a scheduler pass when free.
   (trio cancel scopes and checkpoints cost more than sealing 8 KiB.) Every wait still has its
   deadline: a frozen peer gives PeerTimeout, never a hang.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Literal

import trio

from swarm.errors import FrameError, PeerLost, PeerTimeout, ProtocolError
from swarm.net.channel import (
    DEFAULT_MAX_FRAME,
    DEFAULT_TIMEOUT,
    FastLock,
    MessageChannel,
    SocketReader,
    write_nowait,
)
from swarm.net.sealing import Sealer, SessionKeys

_HDR = struct.Struct(">IQ")  # ciphertext length, frame counter

Carrier = Literal["direct", "libp2p"]


# ----------------------------------------------------------------------------- direct transport


def set_nodelay(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


class DirectTransport:
    """Sealed, counted frames over one TCP socket (see step 3 above).

    The hot path reuses two buffers per direction: frames are sealed straight into the send
    buffer behind their header and go out in one ``send``; received frames are decrypted from
    the socket buffer into a plaintext buffer, and the caller gets one ``bytes`` copy.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        keys: SessionKeys,
        *,
        remote_peer: str,
        initial: bytes = b"",
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.stream = stream
        self.keys = keys
        self.remote_peer = remote_peer
        self.max_frame = max_frame
        c = keys.cipher
        self._tx = Sealer(c, keys.send)
        self._rx = Sealer(c, keys.recv)
        self._tag = c.tag_len
        self._pad = bytes(c.nonce_len - 8)
        self._send_ctr = 0
        self._recv_ctr = 0
        self._pending_hdr: tuple[int, int, bytes] | None = None
        self._reader = SocketReader(stream.socket, remote_peer, initial)
        self._fd = stream.socket.fileno()
        self._out = bytearray(64 * 1024 + _HDR.size + c.tag_len)
        self._plain = bytearray(64 * 1024)

    def _nonce(self, ctr: int) -> bytes:
        return self._pad + ctr.to_bytes(8, "big")

    def seal(self, data: bytes | memoryview) -> memoryview:
        """Header + sealed ``data`` in the send buffer (valid until the next seal)."""
        ctr = self._send_ctr
        if ctr >= 1 << 64:  # unreachable in practice; never let a nonce repeat
            raise ProtocolError(f"direct channel to {self.remote_peer} exhausted its nonces")
        self._send_ctr = ctr + 1
        total = _HDR.size + len(data) + self._tag
        if total > len(self._out):
            self._out = bytearray(total)  # replace, never resize (views may be alive)
        out = memoryview(self._out)
        _HDR.pack_into(out, 0, len(data) + self._tag, ctr)
        self._tx.seal_into(out[_HDR.size : total], data, bytes(out[: _HDR.size]), self._nonce(ctr))
        return out[:total]

    def write_nowait(self, frame: memoryview) -> int:
        """Bytes of a sealed frame the kernel took without waiting (caller holds the send lock)."""
        return write_nowait(self._fd, frame)

    def _check_header(self, hdr: bytes) -> tuple[int, int, bytes]:
        n, ctr = _HDR.unpack(hdr)
        if n < self._tag or n - self._tag > self.max_frame:
            raise FrameError(
                f"peer {self.remote_peer} announced a {n - self._tag}-byte direct frame, "
                f"over the cap of {self.max_frame} (or shorter than its tag)"
            )
        if ctr != self._recv_ctr:
            raise ProtocolError(
                f"peer {self.remote_peer}: direct frame counter {ctr}, expected "
                f"{self._recv_ctr} (replayed, reordered or dropped frame)"
            )
        return n, ctr, hdr

    def _open(self, sealed: memoryview, into: bytearray | None = None) -> bytes | memoryview:
        """The message opened: a ``bytes`` copy, or (``into`` large enough) a view of ``into``,
        opened straight there (no copy: a MiB of model bytes a frame, see FastChannel.receive)."""
        assert self._pending_hdr is not None
        n, ctr, hdr = self._pending_hdr
        self._pending_hdr = None
        m = n - self._tag
        mine = into is None or m > len(into)
        if mine and m > len(self._plain):
            self._plain = bytearray(m)
        plain = memoryview(self._plain if mine else into)[:m]  # type: ignore[arg-type]
        if not self._rx.open_into(plain, sealed, hdr, self._nonce(ctr)):
            raise ProtocolError(
                f"peer {self.remote_peer}: direct frame {ctr} failed authentication "
                "(tampered or corrupted in transit)"
            )
        self._recv_ctr = ctr + 1
        return bytes(plain) if mine else plain

    def receive_nowait(self, into: bytearray | None = None) -> bytes | memoryview | None:
        """The next message if it is already here (caller holds the receive lock), else None."""
        if self._pending_hdr is None:
            hv = self._reader.view_nowait(_HDR.size)
            if hv is None:
                return None
            self._pending_hdr = self._check_header(bytes(hv))
        sealed = self._reader.view_nowait(self._pending_hdr[0])
        return None if sealed is None else self._open(sealed, into)

    async def receive(self, *, just_polled: bool = False, into: bytearray | None = None) -> bytes | memoryview:
        """Caller holds the receive lock and a deadline; cancel-safe between frames' halves.
        ``just_polled``: :meth:`receive_nowait` just found the socket empty."""
        if self._pending_hdr is None:
            hv = await self._reader.view(_HDR.size, just_polled=just_polled)
            self._pending_hdr = self._check_header(bytes(hv))
            just_polled = False
        return self._open(await self._reader.view(self._pending_hdr[0], just_polled=just_polled), into)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


# ----------------------------------------------------------------------------- the channel


class FastChannel:
    """One interface over either path: ``send``/``receive`` whole messages, ``aclose``.

    ``path`` is ``"direct"`` (our sealed TCP socket) or ``"libp2p"`` (the Noise stream).
    Every call has a deadline (``timeout`` or the channel default): a frozen peer raises
    PeerTimeout. A protocol violation closes the channel and raises ProtocolError.
    """

    def __init__(
        self,
        *,
        control: MessageChannel,
        direct: DirectTransport | None,
        timeout: float = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.control = control
        self.direct = direct
        self.local_peer = control.local_peer
        self.remote_peer = control.remote_peer
        self.timeout = timeout
        self.max_frame = max_frame
        self._send_lock = FastLock()
        self._recv_lock = FastLock()
        self.closed = False
        self.on_close: Callable[[], object] | None = None  # e.g. gives the peer's stream slot back

    @property
    def path(self) -> Carrier:
        return "direct" if self.direct is not None else "libp2p"

    @property
    def cipher(self) -> str | None:
        return self.direct.keys.cipher.name if self.direct is not None else None

    def __repr__(self) -> str:
        return f"FastChannel(peer={self.remote_peer}, path={self.path}, cipher={self.cipher})"

    def _check_open(self) -> None:
        if self.closed:
            raise PeerLost(f"channel to {self.remote_peer} is closed")

    async def send(self, data: bytes, timeout: float | None = None) -> None:
        self._check_open()
        if len(data) > self.max_frame:
            raise FrameError(
                f"refusing to send {len(data)} bytes to {self.remote_peer}: "
                f"over the frame cap of {self.max_frame}"
            )
        d = self.direct
        if d is None:
            await self.control.send(data, timeout)
            return
        # Hot path: no cancel scope and no scheduler pass unless something has to wait
        # (the lock is held, or the kernel's send buffer is full).
        limit = self.timeout if timeout is None else timeout
        if not self._send_lock.try_acquire():
            with trio.move_on_after(limit) as waited:
                await self._send_lock.acquire()
            if waited.cancelled_caught:
                raise PeerTimeout(
                    f"sending to {self.remote_peer}: waited {limit} s for the channel"
                )
        try:
            self._check_open()  # re-check under the lock: never write to a recycled fd
            frame = d.seal(data)
            sent = d.write_nowait(frame)
            if sent < len(frame):
                with trio.move_on_after(limit) as scope:
                    await d.stream.send_all(frame[sent:])
                if scope.cancelled_caught:
                    await self.aclose()  # a half-sent frame cannot be resumed
                    raise PeerTimeout(
                        f"sending {len(data)} bytes to {self.remote_peer} took over {limit} s"
                    )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            await self.aclose()
            raise PeerLost(f"direct socket to {self.remote_peer} broke: {exc!r}") from exc
        finally:
            self._send_lock.release()

    async def receive(self, timeout: float | None = None, *, max_len: int | None = None,
                      into: bytearray | None = None) -> bytes | memoryview:  # fmt: skip
        """The next message. ``into``: a buffer the caller owns and does not touch until it is
        done with the message: a direct message that fits is opened straight into it and
        returned as a view of it (a MiB of model bytes a frame: no copy, no fresh pages);
        anything else comes back as ``bytes``."""
        self._check_open()
        d = self.direct
        if d is None:
            return await self.control.receive(timeout, max_len=max_len)
        limit = self.timeout if timeout is None else timeout
        if not self._recv_lock.try_acquire():
            with trio.move_on_after(limit) as waited:
                await self._recv_lock.acquire()
            if waited.cancelled_caught:
                raise PeerTimeout(f"no message from {self.remote_peer} within {limit} s")
        try:
            self._check_open()
            got = d.receive_nowait(into)  # a frame already here needs no cancel scope
            if got is not None:
                return got
            with trio.move_on_after(limit):
                return await d.receive(just_polled=True, into=into)
            raise PeerTimeout(f"no message from {self.remote_peer} within {limit} s")
        except (ProtocolError, PeerLost):
            await self.aclose()
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            await self.aclose()
            raise PeerLost(f"direct socket to {self.remote_peer} broke: {exc!r}") from exc
        finally:
            self._recv_lock.release()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.on_close is not None:
            self.on_close()
        if self.direct is not None:
            await self.direct.aclose()
        await self.control.aclose()
