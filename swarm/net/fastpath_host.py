"""The fast path on a running :class:`~swarm.net.host.SwarmHost`: dial and accept FastChannels.

:func:`open_fastpath_service` starts a direct listener (unless ``direct=False``) and serves
:data:`~swarm.net.fastpath.PROTOCOL_ID` on the host. Only admitted peers get an answer: a stream
from anyone else is reset, exactly like the host's own handlers do. The handshake runs over the
raw libp2p stream (Noise has authenticated the remote peer ID; our framing is
:class:`~swarm.net.channel.FramedChannel`), and the same stream carries the data when no direct
socket can be opened.

Usage (one per node, inside the host's block)::

    async with open_fastpath_service(host, advertise=["192.168.1.5:0"]) as fp:
        ch = await fp.dial(peer)            # initiator: FastChannel, ch.path in {"direct","libp2p"}
        ch = await fp.incoming.receive()    # responder: channels peers opened to us
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from swarm.errors import AdmissionError, PeerTimeout, SwarmError
from swarm.net.channel import DEFAULT_MAX_FRAME, DEFAULT_TIMEOUT, libp2p_channel
from swarm.net.direct import FastChannel
from swarm.net.fastpath import (
    DEFAULT_CIPHERS,
    DEFAULT_DIAL_TIMEOUT,
    DirectListener,
    accept_fastpath,
    open_direct_listener,
    open_fastpath,
)
from swarm.net.sealing import PROTOCOL_ID
from swarm.net.streams import is_foreign_io_error, map_exception

log = logging.getLogger(__name__)


class FastpathService:
    """Dials FastChannels to admitted peers and queues the ones they open to us."""

    def __init__(
        self,
        host: Any,
        listener: DirectListener | None,
        incoming_send: trio.MemorySendChannel[FastChannel],
        incoming: trio.MemoryReceiveChannel[FastChannel],
        *,
        timeout: float,
        dial_timeout: float,
        ciphers: Sequence[str],
        max_frame: int,
    ) -> None:
        self.host = host
        self.listener = listener
        self.incoming = incoming
        self._incoming_send = incoming_send
        self.timeout = timeout
        self.dial_timeout = dial_timeout
        self.ciphers = tuple(ciphers)
        self.max_frame = max_frame

    async def dial(self, peer: str, *, timeout: float | None = None) -> FastChannel:
        """A channel to an admitted ``peer``: direct when its listener is reachable, else libp2p."""
        if not self.host.is_admitted(peer):
            raise AdmissionError(f"peer {peer} is not admitted: refusing to open {PROTOCOL_ID}")
        limit = self.timeout if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                raw = await self.host.libp2p.new_stream(
                    ID.from_base58(peer), [TProtocol(PROTOCOL_ID)]
                )
        except trio.TooSlowError:
            raise PeerTimeout(f"peer {peer}: opening {PROTOCOL_ID} took over {limit} s") from None
        except Exception as exc:
            if is_foreign_io_error(exc):
                raise map_exception(exc, peer, f"opening {PROTOCOL_ID}") from None
            raise
        control = libp2p_channel(
            raw, local_peer=self.host.peer_id, timeout=limit, max_frame=self.max_frame
        )
        return await open_fastpath(
            control,
            timeout=limit,
            dial_timeout=self.dial_timeout,
            ciphers=self.ciphers,
            max_frame=self.max_frame,
        )

    async def _handle(self, raw: Any) -> None:
        peer = str(raw.muxed_conn.peer_id)
        if not self.host.is_admitted(peer):
            log.warning("refused %s stream from unadmitted peer %s", PROTOCOL_ID, peer)
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1.0),
                contextlib.suppress(Exception),
            ):
                await raw.reset()
            return
        # a fast channel is one more inbound stream of its peer: the same per-peer cap
        release = self.host.claim_stream(peer)
        if release is None:
            log.warning("refused a %s stream from %s: it holds every stream slot", PROTOCOL_ID, peer)
            with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(Exception):
                await raw.reset()
            return
        control = libp2p_channel(
            raw, local_peer=self.host.peer_id, timeout=self.timeout, max_frame=self.max_frame
        )
        try:
            channel = await accept_fastpath(
                control,
                self.listener,
                timeout=self.timeout,
                ciphers=self.ciphers,
                max_frame=self.max_frame,
            )
        except SwarmError as exc:
            release()
            log.warning("fast-path handshake with %s failed: %s", peer, exc)
            return
        except BaseException:
            release()
            raise
        # the slot comes back when the channel is closed, or dropped unclosed and collected
        channel.on_close = weakref.finalize(channel, release)
        try:
            self._incoming_send.send_nowait(channel)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning("nobody takes fast-path channels; closing the one from %s", peer)
            await channel.aclose()


@contextlib.asynccontextmanager
async def open_fastpath_service(
    host: Any,
    *,
    direct: bool = True,
    listen_host: str = "127.0.0.1",
    port: int = 0,
    advertise: Sequence[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
    ciphers: Sequence[str] = DEFAULT_CIPHERS,
    max_frame: int = DEFAULT_MAX_FRAME,
    backlog: int = 16,
) -> AsyncIterator[FastpathService]:
    """Serve the fast path on ``host`` (a SwarmHost) until the block ends.

    ``direct=False`` offers no direct address (every channel then uses libp2p streams): for a
    node behind NAT that knows it cannot be dialled. ``advertise`` lists dialable ``ip:port``
    addresses when ``listen_host`` is a wildcard.
    """
    send, recv = trio.open_memory_channel[FastChannel](backlog)
    async with contextlib.AsyncExitStack() as stack:
        listener = None
        if direct:
            listener = await stack.enter_async_context(
                open_direct_listener(listen_host, port, advertise=advertise)
            )
        service = FastpathService(
            host,
            listener,
            send,
            recv,
            timeout=timeout,
            dial_timeout=dial_timeout,
            ciphers=ciphers,
            max_frame=max_frame,
        )
        host.libp2p.set_stream_handler(TProtocol(PROTOCOL_ID), service._handle)
        try:
            yield service
        finally:
            with contextlib.suppress(Exception):
                host.libp2p.remove_stream_handler(TProtocol(PROTOCOL_ID))
            send.close()
            while True:  # channels nobody took: close them
                try:
                    ch = recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                await ch.aclose()
