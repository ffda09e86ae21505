"""The fast path: an encrypted direct TCP socket negotiated over an authenticated libp2p stream.

Theory of operation
-------------------
py-libp2p's Noise + yamux stack costs ~10x plain TCP in RTT on loopback (Python framing and task
switches, not crypto). Activations cross every hop for every token, so data moves over a plain
TCP socket of our own, sealed with an AEAD, and the libp2p stream is used only to agree on keys.

1. Handshake, over a control :class:`~swarm.net.channel.MessageChannel` (a libp2p stream on
   :data:`PROTOCOL_ID`, so Noise has already proven both peer IDs)::

       initiator -> responder   HELLO_I = magic, version, X25519 ephemeral, ciphers offered
       responder -> initiator   HELLO_R = magic, version, X25519 ephemeral, cipher chosen,
                                          direct listener addresses ("host:port", maybe none)

   transcript = BLAKE2b(PROTOCOL_ID, initiator ID, responder ID, HELLO_I, HELLO_R), and four keys
   = BLAKE2b(transcript, key = X25519 shared secret, person = label): one per direction and one
   proof key per role. The cipher choice sits inside the transcript, so it cannot be downgraded
   without breaking Noise first; new ephemerals per session give forward secrecy.
2. The initiator dials the advertised addresses (one short total deadline) and opens with
   ``session id (16) | MAC(proof_i, transcript) (32)``. The listener answers only a valid,
   not-yet-used proof, with ``MAC(proof_r, transcript)``; anything else is closed without a byte
   sent back. The initiator checks that answer (so it reached the right peer, not whoever holds
   the port), then tells the responder on the control channel: ``direct`` or ``fallback``.
   A replayed proof can at worst win the session slot first; the real initiator is then refused,
   says ``fallback``, and the responder drops the impostor's socket.
3. Direct frames: ``u32 length | u64 counter | AEAD(payload)`` with the 12-byte header as
   associated data and the nonce derived from the counter. Counters start at 0 per direction and
   never repeat (separate keys per direction, counter bumped under the send lock); the receiver
   requires exactly the next counter, so a replay or reorder is caught before decryption and a
   flipped byte fails the tag. Either closes the channel with a ProtocolError naming the peer.
   The length is capped before anything is allocated.
4. No address, refused or unreachable dial (NAT, relayed peer), or a wrong answer: the data moves
   over the control channel itself (already Noise-encrypted). :class:`FastChannel` hides which;
   ``channel.path`` says ``"direct"`` or ``"libp2p"``.

5. Hot path (benchmarks/bench_transport.py): sealing goes straight into a reused send buffer
   behind its header, and the frame leaves in one ``os.write`` on the non-blocking socket; only
   when the kernel will not take it all does a cancel scope open around trio's ``send_all``.
   Receiving first tries a non-blocking read of a whole frame; only when it is not there yet does
   a cancel scope open around the wait. Locks are taken without a scheduler pass when free.
   (trio cancel scopes and checkpoints cost more than sealing 8 KiB.) Every wait still has its
   deadline: a frozen peer gives PeerTimeout, never a hang.

Ciphers: AEGIS-256 when libsodium offers it (3-4x faster than ChaCha20-Poly1305 here with AES-NI;
the benchmark records both), else ChaCha20-Poly1305-IETF; both are pynacl's libsodium.
"""

from __future__ import annotations

import collections
import hmac
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import trio
from nacl.public import PrivateKey

from swarm.errors import FrameError, PeerLost, PeerTimeout, ProtocolError, UsageError
from swarm.net.channel import (
    DEFAULT_MAX_FRAME,
    DEFAULT_TIMEOUT,
    BufferedReader,
    FastLock,
    MessageChannel,
    SocketReader,
    write_nowait,
)
from swarm.net.sealing import (
    CIPHERS,
    CIPHERS_BY_NAME,
    DEFAULT_CIPHERS,
    MAC_LEN,
    MAX_HELLO,
    SID_LEN,
    Cipher,
    Hello,
    Sealer,
    SessionKeys,
    derive_keys,
    dh,
    format_address,
    parse_address,
)

log = logging.getLogger(__name__)

DEFAULT_DIAL_TIMEOUT = 1.0
DEFAULT_PROOF_TIMEOUT = 2.0
MAX_UNPROVEN = 64  # direct connections allowed to be waiting for their proof at once; when full,
# the one that has waited longest is dropped for the newcomer: an honest dialer sends its proof
# within one round trip, so a loris holding every slot with idle sockets evicts only itself
DECISION_DIRECT = b"SSFP/direct"
DECISION_FALLBACK = b"SSFP/fallback"

_HDR = struct.Struct(">IQ")  # ciphertext length, frame counter

Path = Literal["direct", "libp2p"]


# ----------------------------------------------------------------------------- direct transport


def _nodelay(stream: trio.SocketStream) -> None:
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

    def _open(self, sealed: memoryview) -> bytes:
        assert self._pending_hdr is not None
        n, ctr, hdr = self._pending_hdr
        self._pending_hdr = None
        m = n - self._tag
        if m > len(self._plain):
            self._plain = bytearray(m)
        plain = memoryview(self._plain)[:m]
        if not self._rx.open_into(plain, sealed, hdr, self._nonce(ctr)):
            raise ProtocolError(
                f"peer {self.remote_peer}: direct frame {ctr} failed authentication "
                "(tampered or corrupted in transit)"
            )
        self._recv_ctr = ctr + 1
        return bytes(plain)

    def receive_nowait(self) -> bytes | None:
        """The next message if it is already here (caller holds the receive lock), else None."""
        if self._pending_hdr is None:
            hv = self._reader.view_nowait(_HDR.size)
            if hv is None:
                return None
            self._pending_hdr = self._check_header(bytes(hv))
        sealed = self._reader.view_nowait(self._pending_hdr[0])
        return None if sealed is None else self._open(sealed)

    async def receive(self, *, just_polled: bool = False) -> bytes:
        """Caller holds the receive lock and a deadline; cancel-safe between frames' halves.
        ``just_polled``: :meth:`receive_nowait` just found the socket empty."""
        if self._pending_hdr is None:
            hv = await self._reader.view(_HDR.size, just_polled=just_polled)
            self._pending_hdr = self._check_header(bytes(hv))
            just_polled = False
        return self._open(await self._reader.view(self._pending_hdr[0], just_polled=just_polled))

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
    def path(self) -> Path:
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

    async def receive(self, timeout: float | None = None, *, max_len: int | None = None) -> bytes:
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
            got = d.receive_nowait()  # a frame already here needs no cancel scope
            if got is not None:
                return got
            with trio.move_on_after(limit):
                return await d.receive(just_polled=True)
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


# ----------------------------------------------------------------------------- listener


@dataclass
class _Pending:
    keys: SessionKeys
    arrived: trio.Event = field(default_factory=trio.Event)
    conn: tuple[trio.SocketStream, bytes] | None = None


class DirectListener:
    """Accepts direct sockets for sessions the responder registered; drops everything else.

    Start with :func:`open_direct_listener`. ``addresses`` is what a responder advertises;
    ``accepted`` / ``rejected`` count proofs (for status views and tests).
    """

    def __init__(
        self,
        listeners: Sequence[trio.SocketListener],
        addresses: Sequence[str],
        proof_timeout: float,
    ) -> None:
        self.listeners = list(listeners)
        self.addresses = tuple(addresses)
        self.proof_timeout = proof_timeout
        self._pending: dict[bytes, _Pending] = {}
        self.accepted = 0
        self.rejected = 0
        self._waiting: collections.OrderedDict[int, trio.CancelScope] = collections.OrderedDict()
        self._next_id = 0

    def register(self, keys: SessionKeys) -> _Pending:
        p = _Pending(keys)
        self._pending[keys.session_id] = p
        return p

    def unregister(self, keys: SessionKeys) -> None:
        self._pending.pop(keys.session_id, None)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for lst in self.listeners:
                nursery.start_soon(self._accept_loop, lst, nursery)
            task_status.started()

    async def _accept_loop(self, lst: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await lst.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                log.warning("direct listener accept failed: %r", exc)
                await trio.sleep(0.1)
                continue
            if len(self._waiting) >= MAX_UNPROVEN:  # a flood of silent dialers cannot pin our fds
                _, oldest = self._waiting.popitem(last=False)
                oldest.cancel()
            self._next_id += 1
            scope = trio.CancelScope()
            self._waiting[self._next_id] = scope
            nursery.start_soon(self._handshake, stream, self._next_id, scope)

    async def _handshake(self, stream: trio.SocketStream, wid: int, scope: trio.CancelScope) -> None:
        handed_over = False
        try:
            _nodelay(stream)
            with scope, trio.move_on_after(self.proof_timeout):
                reader = BufferedReader(stream, "unauthenticated direct dialer")
                head = await reader.exactly(SID_LEN + MAC_LEN)
                sid, mac = head[:SID_LEN], head[SID_LEN:]
                p = self._pending.get(sid)
                if p is None or p.conn is not None or not hmac.compare_digest(mac, p.keys.proof_i):
                    self.rejected += 1
                    log.info("dropped a direct connection without a valid session proof")
                    return
                await stream.send_all(p.keys.proof_r)
                if self._pending.get(sid) is not p:  # the responder gave up meanwhile
                    return
                p.conn = (stream, reader.buffered)
                handed_over = True
                self.accepted += 1
                p.arrived.set()
            if not handed_over:
                self.rejected += 1
                log.info("dropped a direct connection that sent no proof in time")
        except (PeerLost, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.rejected += 1
        finally:
            self._waiting.pop(wid, None)
            if not handed_over:
                await trio.aclose_forcefully(stream)


@asynccontextmanager
async def open_direct_listener(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    advertise: Sequence[str] | None = None,
    proof_timeout: float = DEFAULT_PROOF_TIMEOUT,
) -> AsyncIterator[DirectListener]:
    """Listen for direct sockets on ``host:port``; advertise ``advertise`` (or the bound address).

    A wildcard bind (0.0.0.0 / ::) must name its dialable ``advertise`` addresses explicitly.
    """
    if advertise is None and host in ("", "0.0.0.0", "::"):
        raise UsageError(
            f'direct listener bound to {host or "all interfaces"}: pass advertise=["ip:port"] '
            "with addresses peers can dial (never a wildcard)"
        )
    listeners = await trio.open_tcp_listeners(port, host=host)
    addrs = list(advertise) if advertise is not None else []
    if advertise is None:
        for lst in listeners:
            h, p = lst.socket.getsockname()[:2]
            addrs.append(format_address(h, p))
    for a in addrs:
        parse_address(a)
    listener = DirectListener(listeners, addrs, proof_timeout)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(listener.serve)
            try:
                yield listener
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # hand the caller its own exception, not a group
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:  # outside the cancelled scope, so the caller's own exception is never replaced
        for lst in listeners:
            await trio.aclose_forcefully(lst)


# ----------------------------------------------------------------------------- negotiation


def _pick_cipher(offered: Sequence[int], allowed: Sequence[str], peer: str) -> Cipher:
    ours = {CIPHERS_BY_NAME[n].ident for n in allowed if n in CIPHERS_BY_NAME}
    for ident in offered:
        if ident in ours:
            return CIPHERS[ident]
    raise ProtocolError(f"peer {peer} offers no cipher this node allows ({', '.join(allowed)})")


def _cipher_ids(names: Sequence[str]) -> tuple[int, ...]:
    unknown = [n for n in names if n not in CIPHERS_BY_NAME]
    if unknown or not names:
        raise UsageError(f"unknown or no fast-path ciphers {unknown}; have {list(CIPHERS_BY_NAME)}")
    return tuple(CIPHERS_BY_NAME[n].ident for n in names)


async def _dial(
    addresses: Sequence[str], keys: SessionKeys, peer: str, deadline: float
) -> tuple[trio.SocketStream, bytes] | None:
    with trio.move_on_at(deadline):
        for addr in addresses:
            host, port = parse_address(addr)
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                log.info("direct dial to %s at %s failed: %r", peer, addr, exc)
                continue
            try:
                _nodelay(stream)
                await stream.send_all(keys.session_id + keys.proof_i)
                reader = BufferedReader(stream, peer)
                answer = await reader.exactly(MAC_LEN)
                if hmac.compare_digest(answer, keys.proof_r):
                    return stream, reader.buffered
                log.warning("direct address %s of %s answered a wrong proof", addr, peer)
            except (PeerLost, trio.BrokenResourceError, OSError) as exc:
                log.info("direct handshake with %s at %s failed: %r", peer, addr, exc)
            await trio.aclose_forcefully(stream)
    return None


async def open_fastpath(
    control: MessageChannel,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
    ciphers: Sequence[str] = DEFAULT_CIPHERS,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> FastChannel:
    """Initiator side: handshake over ``control``, then direct socket or fallback."""
    peer = control.remote_peer
    eph = PrivateKey.generate()
    hello_i = Hello(bytes(eph.public_key), _cipher_ids(ciphers)).encode()
    try:
        await control.send(hello_i, timeout)
        hello_r_raw = await control.receive(timeout, max_len=MAX_HELLO)
        hello_r = Hello.decode(hello_r_raw, peer)
        if len(hello_r.ciphers) != 1:
            raise ProtocolError(f"peer {peer} chose {len(hello_r.ciphers)} ciphers, expected one")
        cipher = _pick_cipher(hello_r.ciphers, ciphers, peer)
        keys = derive_keys(
            initiator=True,
            shared=dh(eph, hello_r.ephemeral, peer),
            initiator_id=control.local_peer,
            responder_id=peer,
            hello_i=hello_i,
            hello_r=hello_r_raw,
            cipher=cipher,
        )
        conn = None
        if hello_r.addresses:
            conn = await _dial(hello_r.addresses, keys, peer, trio.current_time() + dial_timeout)
        if conn is None:
            await control.send(DECISION_FALLBACK, timeout)
            return FastChannel(control=control, direct=None, timeout=timeout, max_frame=max_frame)
        await control.send(DECISION_DIRECT, timeout)
    except BaseException:
        await control.aclose()
        raise
    direct = DirectTransport(conn[0], keys, remote_peer=peer, initial=conn[1], max_frame=max_frame)
    return FastChannel(control=control, direct=direct, timeout=timeout, max_frame=max_frame)


async def accept_fastpath(
    control: MessageChannel,
    listener: DirectListener | None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    ciphers: Sequence[str] = DEFAULT_CIPHERS,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> FastChannel:
    """Responder side: answer the hello, offer ``listener``'s addresses (none: libp2p only)."""
    peer = control.remote_peer
    pending: _Pending | None = None
    keys: SessionKeys | None = None
    try:
        hello_i_raw = await control.receive(timeout, max_len=MAX_HELLO)
        hello_i = Hello.decode(hello_i_raw, peer)
        cipher = _pick_cipher(hello_i.ciphers, ciphers, peer)
        eph = PrivateKey.generate()
        addrs = listener.addresses if listener is not None else ()
        hello_r_raw = Hello(bytes(eph.public_key), (cipher.ident,), tuple(addrs)).encode()
        keys = derive_keys(
            initiator=False,
            shared=dh(eph, hello_i.ephemeral, peer),
            initiator_id=peer,
            responder_id=control.local_peer,
            hello_i=hello_i_raw,
            hello_r=hello_r_raw,
            cipher=cipher,
        )
        if listener is not None:
            pending = listener.register(keys)
        await control.send(hello_r_raw, timeout)
        decision = await control.receive(timeout)
        if decision == DECISION_FALLBACK:
            if pending is not None and pending.conn is not None:  # an impostor won the slot
                await trio.aclose_forcefully(pending.conn[0])
                pending.conn = None
            return FastChannel(control=control, direct=None, timeout=timeout, max_frame=max_frame)
        if decision != DECISION_DIRECT or pending is None:
            raise ProtocolError(
                f"peer {peer} sent an unexpected fast-path decision {decision[:32]!r}"
            )
        with trio.move_on_after(timeout):
            await pending.arrived.wait()
        if pending.conn is None:
            raise PeerTimeout(f"peer {peer} chose the direct path but its socket never arrived")
        stream, initial = pending.conn
        pending.conn = None
    except BaseException:
        if pending is not None and pending.conn is not None:
            await trio.aclose_forcefully(pending.conn[0])
        await control.aclose()
        raise
    finally:
        if listener is not None and keys is not None:
            listener.unregister(keys)
    direct = DirectTransport(stream, keys, remote_peer=peer, initial=initial, max_frame=max_frame)
    return FastChannel(control=control, direct=direct, timeout=timeout, max_frame=max_frame)
