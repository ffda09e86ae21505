"""RTTs on the path hops take: a short probe of the fast path to every member that serves.

Theory of operation
-------------------
Heartbeats measure the RTT of the libp2p control stream, whose Noise and yamux framing in Python
add ~2 ms on loopback; hops carry activations over the fast path (swarm/net/fastpath.py: a direct
sealed socket where one opens, ~0.1 ms on loopback; else the libp2p stream). The planner orders
the ring by the RTTs peers advertise, so those should be the hops' own. For each member that holds
a model (its advert offers memory), this node opens a fast channel as a hop would, sends a
:class:`~swarm.proto.control.Probe` as the hello and then ``PINGS`` more, each echoed by the other
end (``Wiring.serve_act``), and closes it. The least round trip is the idle path's (queueing
behind a busy loop only lengthens one), and :meth:`Liveness.path_rtt` makes it that peer's RTT
from then on. A member is probed when first seen and every ``PERIOD_S`` after; a probe that fails
(no fast path there, a timeout) leaves the heartbeats' RTT in place and is retried next period.
Every wait is bounded (``TIMEOUT_S``); a probe never runs while a previous one to that peer does.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import trio

from swarm.errors import ProtocolError, SwarmError
from swarm.node.members.gossip import MembershipService
from swarm.node.ring.fastlink import FrameLink
from swarm.proto import control as ctl

log = logging.getLogger("swarm.node.members.probe")

PINGS = 5  # echoed pings after the hello; the least of them is the RTT
PERIOD_S = 60.0  # a member is probed again after this long
POLL_S = 0.5  # how often new members are looked for
TIMEOUT_S = 3.0  # opening the channel, and each echo


async def probe_once(link: Any, pings: int = PINGS, timeout: float = TIMEOUT_S) -> float:
    """Round trips of Probe frames on an open link (the hello first): the least, in seconds."""
    best = float("inf")
    for _ in range(pings + 1):
        nonce = secrets.randbits(32)  # unguessable: a peer cannot echo a ping it has not received
        sent = trio.current_time()
        await link.send_message(ctl.Probe(nonce), timeout=timeout)
        got = await link.receive_message(timeout=timeout)
        if not isinstance(got, ctl.Probe) or got.nonce != nonce:
            raise SwarmError(f"peer {link.peer}: a probe echo was {got!r}, not the ping just sent")
        best = min(best, trio.current_time() - sent)
    return best


async def echo_probe(
    link: Any, peer: str, hello: ctl.Probe, pings: int = PINGS, timeout: float = TIMEOUT_S
) -> None:
    """The other end: echo the hello and at most ``pings`` more Probe frames, then return."""
    await link.send_message(hello, timeout=timeout)
    for _ in range(pings):
        got = await link.receive_message(timeout=timeout)
        if not isinstance(got, ctl.Probe):
            raise ProtocolError(f"peer {peer}: a probe channel carried {type(got).__name__}")
        await link.send_message(got, timeout=timeout)


class Prober:
    def __init__(self, service: MembershipService, fastpath: Any) -> None:
        self.service = service
        self.fastpath = fastpath
        self._next: dict[str, float] = {}  # peer -> trio time of its next probe
        self._running: set[str] = set()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                view = self.service.membership.view()
                members = [p for p in self.service.members() if view[p].memory_bytes > 0]
                for peer in list(self._next):
                    if peer not in members:
                        del self._next[peer]
                for peer in members:
                    if peer not in self._running and self._next.get(peer, now) <= now:
                        self._next[peer] = now + PERIOD_S
                        self._running.add(peer)
                        nursery.start_soon(self._probe, peer)
                await trio.sleep(POLL_S)

    async def _probe(self, peer: str) -> None:
        try:
            with trio.fail_after(TIMEOUT_S * (PINGS + 2)):
                link = FrameLink(await self.fastpath.dial(peer, timeout=TIMEOUT_S))
                try:
                    rtt = await probe_once(link)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                        await link.close()
            self.service.liveness.path_rtt(peer, rtt)
            log.debug("probed %s on the %s path: %.3f ms", peer, link.path, rtt * 1000)
        except (SwarmError, trio.TooSlowError) as exc:
            log.debug("probing %s failed (its RTT stays the heartbeats'): %s", peer, exc)
        finally:
            self._running.discard(peer)
