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
3. Data then moves as sealed, counted frames over the direct socket (swarm/net/direct.py, with
   the hot path).
4. No address, refused or unreachable dial (NAT, relayed peer), or a wrong answer: the data moves
   over the control channel itself (already Noise-encrypted). :class:`FastChannel` hides which;
   ``channel.path`` says ``"direct"`` or ``"libp2p"``.

Ciphers: AEGIS-256 when libsodium offers it (3-4x faster than ChaCha20-Poly1305 here with AES-NI;
the benchmark records both), else ChaCha20-Poly1305-IETF; both are pynacl's libsodium.
"""

from __future__ import annotations

import collections
import hmac
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from nacl.public import PrivateKey

from swarm.errors import PeerLost, PeerTimeout, ProtocolError, UsageError
from swarm.net.channel import (
    DEFAULT_MAX_FRAME,
    DEFAULT_TIMEOUT,
    BufferedReader,
    MessageChannel,
)
from swarm.net.direct import DirectTransport, FastChannel, set_nodelay
from swarm.net.sealing import (
    CIPHERS,
    CIPHERS_BY_NAME,
    DEFAULT_CIPHERS,
    MAC_LEN,
    MAX_HELLO,
    SID_LEN,
    Cipher,
    Hello,
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
            set_nodelay(stream)
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
                set_nodelay(stream)
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
