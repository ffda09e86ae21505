"""An in-memory network: hosts that admit each other, framed streams, links with delay and
failure; no sockets. N whole nodes run in one trio run, under trio's mock clock.

:class:`MemNet` hands out hosts (:class:`MemHost`) that implement the node's host interface
(``swarm.node.hosting.Host``): admission (the swarm secret, a member or a client credential),
events, framed streams per protocol (the real ``FramedStream`` over in-memory byte pipes, so
frames are encoded and decoded with the real codec and its limits), dialing and hanging up. The
net can then break things the way networks and machines break:

- ``kill(peer)`` is the node's own business (cancel it): its host's connections close, and every
  other host sees the streams reset and a "disconnected" event (a killed process);
- ``freeze(peer)`` stops a node as SIGSTOP does: nothing reaches it or leaves it (bytes wait in
  the pipes, as in socket buffers), events wait for it, and its clock (``clock(peer)``: the one its
  failure detector reads) stands still, so when ``thaw(peer)`` lets it go on it sees the jump;
- ``partition(group, ...)`` makes the groups unreachable from each other (bytes wait, dials
  time out) until ``heal()``; a connection either side hung up meanwhile is gone at the heal.

:class:`MemLink` is one hop on its own (delay, kill, freeze), for ring tests without hosts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio

from swarm.errors import AdmissionError, FrameError, PeerError, PeerLost, PeerTimeout, SwarmError
from swarm.manifest.identity import Identity
from swarm.net.host import HostEvent
from swarm.net.streams import open_framed
from swarm.proto.frame import Frame, FrameDecoder, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, Limits
from swarm.proto.messages import MessageIO

log = logging.getLogger("swarm.testing.memnet")


class MemLink(MessageIO):
    """One hop: ``send`` on the upstream side, ``receive`` on the downstream side."""

    def __init__(self, name: str, *, delay: float = 0.0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.name = self.peer = name
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


# ---------------------------------------------------------------- hosts on an in-memory network


class _Pipe:
    """One direction of a stream: bytes in order, each due ``delay`` after it was written."""

    def __init__(self, net: MemNet, src: str, dst: str, protocol: str = "") -> None:
        self.net, self.src, self.dst, self.protocol = net, src, dst, protocol
        self._send, self._recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        self.reset = False

    def write(self, data: bytes) -> None:
        if self.reset:
            raise trio.BrokenResourceError("stream reset")
        with contextlib.suppress(trio.ClosedResourceError):
            self._send.send_nowait((trio.current_time() + self.net.delay, data))

    def eof(self) -> None:
        self._send.close()

    def kill(self) -> None:
        self.reset = True
        self._send.close()

    async def read(self) -> bytes:
        await self.net.awake(self.dst)  # a stopped process reads nothing, not even a reset
        if self.reset:
            raise trio.BrokenResourceError("stream reset")
        try:
            due, data = await self._recv.receive()
        except trio.EndOfChannel:
            if self.reset:
                raise trio.BrokenResourceError("stream reset") from None
            return b""
        await self.net.passable(self.src, self.dst)  # held while frozen or partitioned
        if self.reset:
            raise trio.BrokenResourceError("stream reset")
        if due > trio.current_time():
            await trio.sleep_until(due)
        return data


class _Raw:
    """One end of a stream as the raw byte stream ``FramedStream`` pumps."""

    def __init__(self, inbound: _Pipe, outbound: _Pipe) -> None:
        self.inbound, self.outbound = inbound, outbound

    async def read(self, n: int = 0) -> bytes:
        return await self.inbound.read()

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        await self.outbound.net.awake(self.outbound.src)  # a stopped process writes nothing
        self.outbound.write(data)

    async def close(self) -> None:
        self.outbound.eof()

    async def reset(self) -> None:
        self.inbound.kill()
        self.outbound.kill()


class _Conn:
    """A connection between two hosts: its streams, and which sides still hold it open."""

    def __init__(self, a: MemHost, b: MemHost) -> None:
        self.hosts = {a.peer_id: a, b.peer_id: b}
        self.open = {a.peer_id: True, b.peer_id: True}
        self.pipes: list[_Pipe] = []

    def other(self, me: str) -> MemHost:
        return next(h for p, h in self.hosts.items() if p != me)


class MemHost:
    """A host on a :class:`MemNet` (see the module docstring); ``member``: holds a member
    credential (a client's host does not)."""

    def __init__(self, net: MemNet, seed: bytes, *, secret: bytes, swarm_id: str, member: bool, nursery: trio.Nursery,
                 revoked: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self.net = net
        self.peer_id = Identity(seed).peer_id
        self.secret, self.swarm_id, self.member, self.revoked = secret, swarm_id, member, revoked
        self.nursery = nursery
        self.limits: Limits = net.limits
        self._handlers: dict[str, Callable[[str, Any], Any]] = {}
        self._roles: dict[str, frozenset[str]] = {}  # protocol -> who may open it (as the real host's door)
        self._subscribers: list[trio.MemorySendChannel[HostEvent]] = []
        self._admitted: dict[str, HostEvent] = {}
        self._pending: list[HostEvent] = []  # events for a frozen host, delivered when it thaws

    def __repr__(self) -> str:
        return f"MemHost({self.peer_id[:12]}…)"

    def addrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}/p2p/{self.peer_id}"]

    def handle(self, protocol: str, handler: Callable[[str, Any], Any], *, roles: Iterable[str] = ("member",)) -> None:
        self._handlers[protocol] = handler
        self._roles[protocol] = frozenset(roles)

    def subscribe(self, max_buffer: int = 256) -> trio.MemoryReceiveChannel[HostEvent]:
        send, recv = trio.open_memory_channel[HostEvent](max_buffer)
        self._subscribers.append(send)
        return recv

    def emit(self, ev: HostEvent) -> None:
        if self.peer_id in self.net.frozen:  # a stopped process learns of it when it runs again
            self._pending.append(ev)
            return
        if ev.kind == "admitted":
            self._admitted[ev.peer] = ev
        elif ev.kind == "disconnected":
            self._admitted.pop(ev.peer, None)
        for ch in list(self._subscribers):
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                ch.send_nowait(ev)

    def is_admitted(self, peer: str) -> bool:
        return peer in self._admitted

    def admitted_peers(self) -> list[str]:
        return sorted(self._admitted)

    def admission_info(self, peer: str) -> HostEvent | None:
        return self._admitted.get(peer)

    def admitted_role(self, peer: str) -> str | None:
        """"member" or "client" by the credential the peer was admitted with (issue 14)."""
        other = self.net.hosts.get(peer)
        if not self.is_admitted(peer) or other is None:
            return None
        return "member" if other.member else "client"

    def has_other_connection(self, peer: str, stream: Any) -> bool:
        return False

    def path_label(self, peer: str) -> str:
        return "direct" if self.is_admitted(peer) else "none"

    async def settle_path(self, peer: str, *, timeout: float) -> None:
        await trio.lowlevel.checkpoint()

    async def dial(self, addr: str, *, timeout: float | None = None) -> str:
        peer = addr.rsplit("/p2p/", 1)[-1]
        return await self.net.connect(self, peer, addr, timeout=self.net.dial_timeout if timeout is None else timeout)

    async def disconnect(self, peer: str) -> None:
        await trio.lowlevel.checkpoint()
        self.net.hang_up(self, peer)

    @contextlib.asynccontextmanager
    async def open_stream(self, peer: str, protocol: str, *, timeout: float | None = None) -> AsyncIterator[Any]:
        conn = self.net.conns.get(frozenset((self.peer_id, peer)))
        if conn is None or not conn.open[self.peer_id] or not self.is_admitted(peer):
            raise AdmissionError(f"peer {peer} is not admitted: refusing to open {protocol}")
        remote = conn.other(self.peer_id)
        limit = 10.0 if timeout is None else timeout
        with trio.move_on_after(limit) as opening:
            await self.net.passable(self.peer_id, peer)  # negotiating the protocol takes a round trip
        if opening.cancelled_caught:
            raise PeerTimeout(f"peer {peer}: timed out opening {protocol} after {limit:g} s")
        if protocol not in remote._handlers:
            raise PeerError(f"peer {peer}: protocol {protocol} not supported")
        out, back = _Pipe(self.net, self.peer_id, peer, protocol), _Pipe(self.net, peer, self.peer_id, protocol)
        conn.pipes += [out, back]
        remote.nursery.start_soon(remote._serve, protocol, self.peer_id, _Raw(out, back))
        async with open_framed(_Raw(back, out), peer=peer, protocol=protocol, limits=self.limits) as fs:
            yield fs

    async def _serve(self, protocol: str, peer: str, raw: _Raw) -> None:
        if self.admitted_role(peer) not in self._roles.get(protocol, frozenset({"member"})):
            log.warning("%s: refused %s stream from %s peer %s", self, protocol, self.admitted_role(peer), peer)
            with contextlib.suppress(Exception):
                await raw.reset()
            return
        try:
            async with open_framed(raw, peer=peer, protocol=protocol, limits=self.limits) as fs:
                await self._handlers[protocol](peer, fs)
        except PeerError as exc:
            log.debug("%s stream from %s ended: %s", protocol, peer, exc)
        except FrameError as exc:  # bytes no honest peer sends: drop the peer, as the real host does
            log.warning("%s: %s broke the wire protocol on %s: %s", self, peer, protocol, exc)
            self.net.hang_up(self, peer)
        except SwarmError as exc:
            log.warning("%s stream from %s failed: %s", protocol, peer, exc)
        except Exception:  # as the real host: a handler's bug is logged, never propagated
            log.exception("handler for %s crashed on a stream from %s", protocol, peer)


class MemNet:
    """Hosts, their connections, and the faults the test injects (see the module docstring)."""

    def __init__(self, *, delay: float = 0.0005, dial_timeout: float = 5.0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.delay = delay
        self.dial_timeout = dial_timeout
        self.limits = limits
        self.hosts: dict[str, MemHost] = {}
        self.conns: dict[frozenset[str], _Conn] = {}
        self.frozen: dict[str, float] = {}  # peer -> trio time it was frozen at
        self._apart: set[frozenset[str]] = set()  # pairs that cannot reach each other
        self._changed = trio.Event()
        self._seeds = itertools.count(1)

    # -- hosts --------------------------------------------------------------------------------

    def opener(self, *, member: bool = True) -> Callable[[Any], contextlib.AbstractAsyncContextManager[MemHost]]:
        """``open_host`` for ``swarm.node.peer.open_peer``: a host for these settings."""
        return lambda s: self.open_host(s.seed, secret=s.secret, swarm_id=s.swarm_id, member=member, revoked=s.revoked)

    @contextlib.asynccontextmanager
    async def open_host(self, seed: bytes, *, secret: bytes, swarm_id: str, member: bool = True,
                        revoked: frozenset[str] = frozenset()) -> AsyncIterator[MemHost]:  # fmt: skip
        async with trio.open_nursery() as nursery:
            host = MemHost(self, seed, secret=secret, swarm_id=swarm_id, member=member, nursery=nursery,
                           revoked=revoked)  # fmt: skip
            self.hosts[host.peer_id] = host
            try:
                yield host
            finally:
                mine = [k for k, c in self.conns.items() if c.hosts.get(host.peer_id) is host]
                for key in mine:
                    self._close(self.conns.pop(key))  # a process that ends closes its connections
                if self.hosts.get(host.peer_id) is host:  # (a restart with the same key may be up already)
                    del self.hosts[host.peer_id]
                nursery.cancel_scope.cancel()

    def clock(self, peer: str) -> Callable[[], float]:
        """``peer``'s clock: trio's, standing still while the peer is frozen."""
        return lambda: self.frozen.get(peer, trio.current_time())

    # -- reachability ---------------------------------------------------------------------------

    def reachable(self, a: str, b: str) -> bool:
        return a not in self.frozen and b not in self.frozen and frozenset((a, b)) not in self._apart

    async def awake(self, peer: str) -> None:
        """Return once ``peer`` is not frozen (its I/O, even a failing one, waits until then)."""
        while peer in self.frozen:
            await self._changed.wait()

    async def passable(self, a: str, b: str) -> None:
        """Return once bytes can go from ``a`` to ``b``."""
        while not self.reachable(a, b):
            await self._changed.wait()

    def _news(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        for conn in list(self.conns.values()):  # hang-ups that could not reach the other side yet
            a, b = conn.hosts
            if not all(conn.open.values()) and self.reachable(a, b):
                self._close(self.conns.pop(frozenset((a, b))))

    def freeze(self, peer: str) -> None:
        self.frozen[peer] = trio.current_time()
        self._news()

    def thaw(self, peer: str) -> None:
        self.frozen.pop(peer, None)
        host = self.hosts.get(peer)
        if host is not None:
            pending, host._pending = host._pending, []
            for ev in pending:
                host.emit(ev)
        self._news()

    def partition(self, *groups: Iterable[str]) -> None:
        """Peers in different groups cannot reach each other until :meth:`heal`."""
        sets = [set(g) for g in groups]
        for i, g in enumerate(sets):
            for h in sets[i + 1 :]:
                self._apart |= {frozenset((a, b)) for a in g for b in h}
        self._news()

    def heal(self) -> None:
        self._apart.clear()
        self._news()

    # -- connections ----------------------------------------------------------------------------

    async def connect(self, me: MemHost, peer: str, addr: str, *, timeout: float) -> str:
        with trio.move_on_after(timeout):
            await self.passable(me.peer_id, peer)
            other = self.hosts.get(peer)
            if other is None or peer == me.peer_id:
                raise PeerError(f"nothing listens at {addr}")
            if other.secret != me.secret or other.swarm_id != me.swarm_id or me.peer_id in other.revoked:
                raise AdmissionError(f"peer {peer} refused admission (another swarm, or revoked)")
            key = frozenset((me.peer_id, peer))
            conn = self.conns.get(key)
            if conn is not None and all(conn.open.values()):
                return peer
            if conn is not None:
                self._close(self.conns.pop(key))
            self.conns[key] = _Conn(me, other)
            me.emit(HostEvent("admitted", peer, addr, outbound=True))
            other.emit(HostEvent("admitted", me.peer_id, me.addrs()[0], outbound=False))
            return peer
        raise PeerTimeout(f"dialing {addr} timed out after {timeout:g} s")

    def hang_up(self, me: MemHost, peer: str) -> None:
        """``me`` closes its connection to ``peer``; the other side learns it once it can."""
        key = frozenset((me.peer_id, peer))
        conn = self.conns.get(key)
        if conn is None:
            return
        conn.open[me.peer_id] = False
        if self.reachable(me.peer_id, peer):
            self._close(self.conns.pop(key))
            return
        for pipe in conn.pipes:  # our side of every stream is gone now
            if pipe.dst == me.peer_id:
                pipe.kill()
        me.emit(HostEvent("disconnected", peer))

    def _close(self, conn: _Conn) -> None:
        for pipe in conn.pipes:
            pipe.kill()
        for me, host in conn.hosts.items():
            if conn.open[me]:  # the side that hung up already heard of it
                host.emit(HostEvent("disconnected", conn.other(me).peer_id))

    def cut(self, a: str, b: str) -> None:
        """Close the connection between ``a`` and ``b`` at once (both see it reset)."""
        conn = self.conns.pop(frozenset((a, b)), None)
        if conn is not None:
            self._close(conn)


if TYPE_CHECKING:  # mypy checks that a MemHost is a host as node/ sees one

    from swarm.node.hosting import Host

    def _a_memhost_is_a_host(h: MemHost) -> Host:
        return h
