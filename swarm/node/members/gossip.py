"""Membership on a host: ctl links, heartbeats, gossip of adverts, dialing (the view itself is
``membership.py``).

Theory of operation
-------------------
:class:`MembershipService` runs the view on a host (hosting.Host: libp2p, or memnet). For each admitted
peer it opens an outbound ctl stream (heartbeats, adverts: see ``heartbeat.py``) and serves the
peer's inbound one. Adverts are gossiped: a new advert heard from one peer is forwarded to the
others (signatures make relaying safe), so a node that dialed only the bootstrap learns every
member and dials it (the lower peer ID dials first; either dials after a grace period). When the
failure detector declares a peer lost, its advert is dropped and its connection closed; if it
comes back it is admitted again and rejoins as a new incarnation.

The advert book is bounded (membership.py); when it is full, a connected newcomer evicts the
peer this service's failure detector heard from least recently (``Membership.guard_book``).

Discovery hooks: :meth:`MembershipService.add_candidate` takes a dialable multiaddr from any
source (mDNS, a relay, the manifest's bootstrap list); wildcard addresses and our own peer ID are
never dialed. A circuit address (``<relay>/p2p-circuit/p2p/<peer>``) names the peer last.

Hubs. The bootstrap runs a service with ``publish=False``: it forwards every advert like any
member but never sends its own, so it is never in anyone's view (never planned, never leader),
and it links back only to peers that open a ctl link to it, so a client or a relay-only peer is
not dropped as silent. Members are peers that advertised: a client (status, generate) or the hub
is admitted and beats but never "joins" or "leaves" in anyone's events.

After DCUtR, a relayed and a direct connection to one peer coexist until the relayed one is
closed (py-libp2p waits 60 s); a ctl link on the relayed one then ends, and it is reopened on
the direct one at once instead of the peer being declared lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarm.errors import AdmissionError, PeerError, PeerLost, ProtocolError, SwarmError, UsageError
from swarm.net.host import HostEvent, is_wildcard
from swarm.net.streams import FramedStream
from swarm.node.dispatch import role_of
from swarm.node.hosting import Host
from swarm.node.members.failure import PeerState, Transition
from swarm.node.members.heartbeat import DEFAULT_INTERVAL, Liveness, run_ctl_link, serve_ctl_inbound
from swarm.node.members.membership import Membership
from swarm.proto.limits import PROTO_CTL
from swarm.proto.messages import Advert

log = logging.getLogger("swarm.node.members.membership")

READVERT_PERIOD = 2.0  # seconds between re-adverts for RTTs that merely moved
READVERT_POLL = 0.25  # a peer's first RTT (or its loss) is advertised within this
DIAL_PERIOD = 0.5
DIAL_GRACE = 2.0  # a higher peer ID waits this long for the lower one to dial it
MAX_BACKOFF = 5.0
MAX_CANDIDATES = 512  # dialable addresses kept (2,000 adverts of one member once made 32,000)
CANDIDATE_TTL_S = 120.0  # a learned address whose peer is not admitted for this long is forgotten


# ---------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class MemberEvent:
    """For the UI: ``kind`` is joined, rejoined, suspect, alive, left, refused or updated."""

    kind: str
    peer: str
    addr: str = ""
    how: str = ""  # "dialed", "inbound"
    rtt_ms: float | None = None
    reason: str = ""
    incarnation: int = 0


@dataclass
class _Candidate:
    addr: str
    peer: str
    source: str
    first_seen: float
    next_try: float = 0.0
    backoff: float = 0.5


class MembershipService:
    """Runs membership, heartbeats and gossip on a host; see the module docstring."""

    def __init__(
        self,
        host: Host,
        membership: Membership,
        *,
        clock: Callable[[], float] = trio.current_time,
        interval: float = DEFAULT_INTERVAL,
        on_event: Callable[[MemberEvent], None] | None = None,
        on_stall: Callable[[float], None] | None = None,
        publish: bool = True,
    ) -> None:
        if host.peer_id != membership.peer_id:
            raise UsageError("the host's peer ID and the membership signer's peer ID differ (one seed for both)")
        self.host = host
        self.membership = membership
        # False: a hub (the bootstrap) that forwards adverts, never its own, and links only to
        # peers that link to it
        self.publish = publish
        self._announced: set[str] = set()  # peers whose "joined" was emitted (they advertised)
        self.interval = interval
        self.liveness = Liveness(on_transition=self._on_transition, clock=clock, on_stall=on_stall)
        # a full advert book makes room for a connected newcomer by the peer heard from least recently
        membership.guard_book(last_heard=self.liveness.detector.last_heard)
        self._on_event = on_event
        self._outboxes: dict[str, trio.MemorySendChannel[Advert]] = {}
        self._links: dict[str, trio.CancelScope] = {}
        self._candidates: dict[str, _Candidate] = {}
        self._nursery: trio.Nursery | None = None
        self.events_log: list[MemberEvent] = []

    # -- public ------------------------------------------------------------------------------

    def add_candidate(self, addr: str, source: str = "manual") -> None:
        """A multiaddr (with ``/p2p/<id>``) worth dialing: bootstrap, mDNS, relay circuit."""
        i = addr.rfind("/p2p/")  # the last one: a circuit address names its relay first
        if i < 0:
            raise UsageError(f"{source} address {addr!r} lacks /p2p/<peer id>")
        peer = addr[i + 5 :].split("/")[0]
        if peer == self.host.peer_id or addr in self._candidates or is_wildcard(addr):
            return  # never dial ourselves, nor a wildcard (it reaches our own listener)
        if len(self._candidates) >= MAX_CANDIDATES:
            learned = [c for c in self._candidates.values() if _learned(c)]
            if not learned:
                return
            del self._candidates[min(learned, key=lambda c: c.first_seen).addr]  # the oldest learned goes
        self._candidates[addr] = _Candidate(addr, peer, source, trio.current_time())

    def members(self) -> list[str]:
        """Live members (alive or suspect, admitted, and advertised) other than us, sorted.
        A client (status, generate) or the bootstrap hub is admitted and beats, but never
        advertises: it is no member."""
        view = self.membership.view()
        return [p for p in self.liveness.detector.live_peers() if self.host.is_admitted(p) and p in view]

    def rtt_ms(self, peer: str) -> float | None:
        return self.liveness.rtt_ms(peer)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Start with ``await nursery.start(service.run)``."""
        events = self.host.subscribe()
        self.host.handle(PROTO_CTL, self._serve_inbound)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._watch_host, events)
            nursery.start_soon(self.liveness.watch, self.interval / 2)
            nursery.start_soon(self._dialer)
            nursery.start_soon(self._readvertiser)
            for peer in self.host.admitted_peers():  # admitted before we started
                self._admitted(HostEvent("admitted", peer))
            task_status.started()

    # -- host events and links ---------------------------------------------------------------

    async def _watch_host(self, events: trio.MemoryReceiveChannel[HostEvent]) -> None:
        async for ev in events:
            if ev.kind == "admitted":
                self._admitted(ev)
            elif ev.kind == "disconnected":
                self.liveness.lost(ev.peer, "connection closed")
            elif ev.kind == "refused":
                self._emit(MemberEvent("refused", ev.peer, ev.addr, reason=ev.reason))

    def _admitted(self, ev: HostEvent) -> None:
        self.membership.confirm(ev.peer)  # its advert, if gossip brought one, no longer expires
        if self._nursery is None or ev.peer in self._links or not self.publish:
            return  # a hub links to a peer once the peer links to it (see _serve_inbound)
        self.liveness.heard(ev.peer)
        self._start_link(ev.peer)

    def _start_link(self, peer: str) -> None:
        """Open our outbound ctl link to ``peer``: our advert and every advert we know go first."""
        assert self._nursery is not None
        send, recv = trio.open_memory_channel[Advert](256)
        self._outboxes[peer] = send
        if self.publish:
            send.send_nowait(self.membership.local)
        # adverts of peers that connected to us first; the outbox is bounded, and a member that
        # made up a book full of adverts once crashed every node here (WouldBlock) on the next link
        unconfirmed = set(self.membership.unconfirmed())
        view = self.membership.view()
        for other in sorted(view, key=lambda p: p in unconfirmed):
            if other not in (peer, self.host.peer_id):
                with contextlib.suppress(trio.WouldBlock):
                    send.send_nowait(view[other])
        scope = trio.CancelScope()
        self._links[peer] = scope
        self._nursery.start_soon(self._link, peer, scope, recv)

    async def _link(self, peer: str, scope: trio.CancelScope, outbox: trio.MemoryReceiveChannel[Advert]) -> None:
        link: FramedStream | None = None
        try:
            with scope:
                async with self.host.open_stream(peer, PROTO_CTL, timeout=self.interval * 6) as fs:
                    link = fs
                    await run_ctl_link(fs, self.liveness, outbox, interval=self.interval)
        except (PeerLost, AdmissionError) as exc:  # gone (EOF, reset) or dropped: lost at once
            if isinstance(exc, PeerLost) and link is not None and self.host.has_other_connection(peer, link):
                # Only the connection under this link closed (a relayed one, after DCUtR made a
                # direct one): the peer is still here; reopen the link on the other connection.
                log.debug("ctl link to %s lost its connection (%s); another is up: reopening", peer, exc)
                self._reopen(peer, scope, delay=0.0)
                return
            reason = str(exc)
            log.debug("ctl link to %s ended: %s", peer, exc)
            self.liveness.lost(peer, reason)
        except PeerError as exc:  # a stalled write: silence is the failure detector's call
            log.debug("ctl link to %s stalled: %s; reopening", peer, exc)
            self._reopen(peer, scope)
        except SwarmError as exc:
            reason = str(exc)
            log.warning("ctl link to %s failed: %s", peer, exc)
            self.liveness.lost(peer, reason)
        finally:
            if self._links.get(peer) is scope:
                del self._links[peer]
                self._outboxes.pop(peer, None)

    def _reopen(self, peer: str, scope: trio.CancelScope, *, delay: float | None = None) -> None:
        if self._links.get(peer) is scope and self._nursery is not None:
            del self._links[peer]
            self._outboxes.pop(peer, None)
            self._nursery.start_soon(self._relink, peer, self.interval if delay is None else delay)

    async def _relink(self, peer: str, delay: float) -> None:
        """Reopen a link after ``delay`` (a stalled one: a beat), unless the peer was lost or
        dropped meanwhile."""
        await trio.sleep(delay)
        if self.host.is_admitted(peer) and peer not in self._links and self.liveness.state(peer) is not PeerState.LOST:
            self._start_link(peer)

    async def _serve_inbound(self, peer: str, fs: FramedStream) -> None:
        if not self.publish and peer not in self._links and self._nursery is not None:
            # A hub only links back to peers that run membership themselves: a client, or a
            # `join --diagnose` or a relay-only peer, speaks no ctl and must not be dropped as
            # silent (it may be using this node as its relay).
            self.liveness.heard(peer)
            self._start_link(peer)
        await serve_ctl_inbound(fs, self.liveness, self._on_advert)

    async def _on_advert(self, from_peer: str, advert: Advert) -> None:
        if role_of(self.host, advert.peer_id, True) == "client" or role_of(self.host, from_peer, True) == "client":
            log.warning("ignored an advert of %s relayed by %s: a client may not advertise", advert.peer_id, from_peer)
            return  # a client (generate and status only) is never a member, whoever relays its advert
        try:
            news = self.membership.offer(advert, now=trio.current_time(), connected=self.host.is_admitted(advert.peer_id))
        except ProtocolError as exc:
            log.warning("ignored an advert relayed by %s: %s", from_peer, exc)
            return
        if not news:
            return
        peer = advert.peer_id
        if peer not in self._announced and self.liveness.state(peer) in (PeerState.ALIVE, PeerState.SUSPECT):
            self._announce(peer)  # its first advert: now it is a member we can name
        self._emit(MemberEvent("updated", peer, advert.addrs[0] if advert.addrs else ""))
        for addr in advert.addrs:
            if "/p2p/" in addr and not is_wildcard(addr):
                with contextlib.suppress(UsageError):
                    self.add_candidate(addr, source=f"advert via {from_peer[-8:]}")
        for peer, box in list(self._outboxes.items()):
            if peer not in (from_peer, advert.peer_id):
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    box.send_nowait(advert)

    def _announce(self, peer: str) -> None:
        self._announced.add(peer)
        info = self.host.admission_info(peer)
        addr = info.addr if info else ""
        how = ("dialed" if info.outbound else "inbound") if info else ""
        incarnation = self.liveness.detector.incarnation(peer)
        self._emit(MemberEvent("rejoined" if incarnation else "joined", peer, addr, how, incarnation=incarnation))

    def _on_transition(self, t: Transition) -> None:
        info = self.host.admission_info(t.peer)
        addr = info.addr if info else ""
        how = ("dialed" if info.outbound else "inbound") if info else ""
        # Only members (peers that advertised) are news: a client or the bootstrap hub beats
        # but never advertises, so it never "joins" or "leaves" in anyone's output.
        announced = t.peer in self._announced
        if t.new is PeerState.LOST:
            self._announced.discard(t.peer)
            self.membership.forget(t.peer)
            for cand in self._candidates.values():  # try to reach it again promptly
                if cand.peer == t.peer:
                    cand.backoff, cand.next_try = 0.5, 0.0
            scope = self._links.pop(t.peer, None)
            self._outboxes.pop(t.peer, None)
            if scope is not None:
                scope.cancel()
            if self._nursery is not None and self.host.is_admitted(t.peer):
                self._nursery.start_soon(self.host.disconnect, t.peer)
            if announced:
                self._emit(MemberEvent("left", t.peer, addr, how, reason=t.reason, incarnation=t.incarnation))
        elif not announced:
            if t.peer in self.membership.view():  # back before its advert was forgotten, or known by gossip
                self._announced.add(t.peer)
                kind = "rejoined" if t.rejoined else "joined"
                self._emit(MemberEvent(kind, t.peer, addr, how, reason=t.reason, incarnation=t.incarnation))
        elif t.new is PeerState.SUSPECT:
            self._emit(MemberEvent("suspect", t.peer, addr, how, reason=t.reason, incarnation=t.incarnation))
        elif t.old is None:
            self._emit(MemberEvent("joined", t.peer, addr, how, incarnation=t.incarnation))
        elif t.rejoined:
            self._emit(MemberEvent("rejoined", t.peer, addr, how, reason=t.reason, incarnation=t.incarnation))
        else:
            self._emit(MemberEvent("alive", t.peer, addr, how, incarnation=t.incarnation))

    def _emit(self, ev: MemberEvent) -> None:
        if ev.rtt_ms is None:
            ev = dataclasses.replace(ev, rtt_ms=self.liveness.rtt_ms(ev.peer))
        self.events_log.append(ev)
        del self.events_log[:-1000]
        if self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:
                log.exception("membership event callback failed")

    # -- background loops --------------------------------------------------------------------

    def _age_candidates(self, now: float) -> None:
        """Forget adverts whose peer never connected, and learned addresses (adverts, mDNS) not
        useful for CANDIDATE_TTL_S; a bootstrap or --peer address is kept for good."""
        for peer in self.membership.unconfirmed():
            if self.host.is_admitted(peer):  # its advert came before its admission was known here
                self.membership.confirm(peer)
        for peer in self.membership.expire(now):
            log.info("forgot the advert of %s: it never connected", peer)
        for cand in list(self._candidates.values()):
            if self.host.is_admitted(cand.peer):
                cand.first_seen = now  # in use: the clock restarts
            elif _learned(cand) and now - cand.first_seen > CANDIDATE_TTL_S:
                del self._candidates[cand.addr]

    async def _dialer(self) -> None:
        while True:
            now = trio.current_time()
            self._age_candidates(now)
            for cand in list(self._candidates.values()):
                if self.host.is_admitted(cand.peer) or now < cand.next_try:
                    continue
                learned = cand.source.startswith("advert")
                if learned and self.host.peer_id > cand.peer and now - cand.first_seen < DIAL_GRACE:
                    continue  # let the lower peer ID dial; avoids two dials crossing
                cand.next_try = now + cand.backoff
                cand.backoff = min(MAX_BACKOFF, cand.backoff * 2)
                assert self._nursery is not None
                self._nursery.start_soon(self._dial, cand)
            await trio.sleep(DIAL_PERIOD)

    async def _dial(self, cand: _Candidate) -> None:
        try:
            await self.host.dial(cand.addr)
            cand.backoff = 0.5
        except (PeerError, UsageError) as exc:
            log.debug("dial %s (%s) failed: %s", cand.addr, cand.source, exc)

    async def _readvertiser(self) -> None:
        """Re-advertise our RTTs: at once when a peer gains or loses its first measurement (the
        leader cannot plan an edge nobody measured), at most every READVERT_PERIOD otherwise."""
        last: dict[str, float] = {}
        last_at = -READVERT_PERIOD
        while True:
            await trio.sleep(READVERT_POLL)
            rtts = {p: v for p, v in self.liveness.rtts_ms().items() if self.host.is_admitted(p)}
            now = trio.current_time()
            due = set(rtts) != set(last) or (now - last_at >= READVERT_PERIOD and _rtts_changed(last, rtts))
            if due and self.publish and self.membership.update_local(rtt_ms=rtts):
                last, last_at = rtts, now
                local = self.membership.local
                for box in list(self._outboxes.values()):
                    with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                        box.send_nowait(local)

    def readvertise(self) -> None:
        """Send our current advert to every peer now (after update_local)."""
        if not self.publish:
            return
        local = self.membership.local
        for box in list(self._outboxes.values()):
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                box.send_nowait(local)


def _rtts_changed(old: dict[str, float], new: dict[str, float]) -> bool:
    """Re-advertise when the set of peers changes or any RTT moves by > 20% and > 0.2 ms."""
    if set(old) != set(new):
        return True
    return any(abs(new[p] - old[p]) > max(0.2, 0.2 * old[p]) for p in new)


def _learned(cand: _Candidate) -> bool:
    """A candidate someone else told us of (an advert, mDNS), not one the user gave."""
    return cand.source.startswith(("advert", "mdns"))
