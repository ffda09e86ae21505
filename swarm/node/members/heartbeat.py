"""Heartbeats on the ctl protocol: liveness evidence for the failure detector, and RTTs.

Theory of operation
-------------------
Between two admitted peers each side opens its own outbound ``ctl`` stream. On it, the sender
writes a HEARTBEAT every ``interval`` seconds carrying a beat number and its clock (microseconds
of ``trio.current_time()``) and whatever else it has to say (adverts); the other side's inbound
handler echoes each HEARTBEAT back unchanged. The RTT is measured from the sender's own record
of when it sent that beat, never from the echoed clock: an echo of a beat we did not send (or
already heard) is ignored, so a peer can delay its echoes (a longer RTT) but cannot make the RTT
others measure to it shorter, or anything it likes. So every peer measures its own round trip to every
other peer with frames that already flow (our own ping: one frame each way on an open stream,
~10x cheaper than a libp2p ping, which opens a new stream and negotiates it each time), and every
frame heard on either stream is evidence that the peer is alive.

:class:`Liveness` joins that evidence to the pure :class:`~swarm.node.members.failure.FailureDetector`:
it reads ``trio.current_time()`` (so a test on trio's MockClock controls time) and calls
``on_transition`` for each alive/suspect/lost/rejoined change. :func:`run_ctl_link` and
:func:`serve_ctl_inbound` work on any :class:`~swarm.net.streams.FramedStream`, including one over
an in-memory stream pair, which is how the tests run them on a MockClock without sockets.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from swarm.errors import PeerError, ProtocolError, SwarmError
from swarm.net.streams import FramedStream
from swarm.node.members.failure import FailureDetector, PeerState, Transition
from swarm.proto.messages import Advert, Heartbeat, message_name

log = logging.getLogger("swarm.node.members.heartbeat")

DEFAULT_INTERVAL = 0.5  # seconds between heartbeats; with failure.py's defaults: lost within ~3 s
RTT_SAMPLES = 16  # the RTT is the least of the last this many round trips (8 s at the default interval)
OUTSTANDING_BEATS = 16  # beats awaiting their echo that still count for an RTT
STALL_S = 2.0  # a gap this long between our own ticks means we were stopped (SIGSTOP, a laptop asleep)

OnTransition = Callable[[Transition], None]
OnAdvert = Callable[[str, Advert], Awaitable[None]]


def _now_us() -> int:
    return int(trio.current_time() * 1_000_000)


class Liveness:
    """The failure detector on the trio clock, plus per-peer RTT estimates: the least of the last
    :data:`RTT_SAMPLES` heartbeat round trips. A round trip can only be lengthened by what it met
    on the way (a peer's loop busy loading a model or computing, a queue in front of the frame),
    never shortened, so the least is the idle link's, which is what the planner orders the ring
    by; a median would take a few seconds of load for a slower link."""

    def __init__(
        self, detector: FailureDetector | None = None, on_transition: OnTransition | None = None,
        clock: Callable[[], float] = trio.current_time, on_stall: Callable[[float], None] | None = None,
    ) -> None:  # fmt: skip
        self.detector = detector or FailureDetector()
        self.clock = clock  # this node's clock (an in-memory test stops a "frozen" node's)
        self._on_transition = on_transition
        self.on_stall = on_stall  # called with the gap after we were stopped
        self._rtts: dict[str, deque[float]] = {}
        self._path_rtts: dict[str, float] = {}  # probed on the path hops take (swarm.node.members.probe)
        self._ran_at: float | None = None  # our clock when this node last ran its liveness code
        self._stall_s = max(STALL_S, 2 * DEFAULT_INTERVAL)  # a gap this long: we were stopped (watch sets it)

    def _emit(self, transitions: list[Transition]) -> None:
        for t in transitions:
            if t.new is PeerState.LOST:
                self._rtts.pop(t.peer, None)
                self._path_rtts.pop(t.peer, None)
            if self._on_transition is not None:
                self._on_transition(t)

    def heard(self, peer: str) -> None:
        self._emit(self.detector.heard(peer, self.clock()))

    def lost(self, peer: str, reason: str) -> None:
        self.catch_stall()  # news that arrived while we were stopped is judged after the stall
        self._emit(self.detector.declare_lost(peer, self.clock(), reason))

    def tick(self) -> None:
        self.catch_stall()
        self._emit(self.detector.tick(self.clock()))

    def catch_stall(self) -> None:
        """If this node has not run for ``_stall_s`` or more, it was stopped (SIGSTOP, a laptop
        asleep): its own silence is excused (nobody is declared lost for it) and ``on_stall`` is
        told, at once. Called before any liveness news is acted on, and by the leader before it
        plans: after a stop, tasks wake in any order, and the first to run must not act on a
        stale view (a peer's closed connection, the others' silence) before the stall is known."""
        now = self.clock()
        last, self._ran_at = self._ran_at, now
        if last is None or now - last < self._stall_s:
            return
        log.warning("this node was stopped for %.1f s", now - last)
        self.detector.excuse_silence(now)
        if self.on_stall is not None:
            self.on_stall(now - last)

    def state(self, peer: str) -> PeerState | None:
        return self.detector.state(peer)

    def rtt_sample(self, peer: str, seconds: float) -> None:
        if seconds >= 0:
            self._rtts.setdefault(peer, deque(maxlen=RTT_SAMPLES)).append(seconds)

    def path_rtt(self, peer: str, seconds: float) -> None:
        """The least round trip of a probe on the path hops to ``peer`` take (the fast path's
        direct socket when it opens, else its libp2p stream): from now on the RTT of ``peer``."""
        if seconds >= 0 and self.detector.state(peer) not in (None, PeerState.LOST):
            self._path_rtts[peer] = seconds

    def rtt_ms(self, peer: str) -> float | None:
        """The probed path's RTT once a probe ran, else the heartbeats' (the control stream's)."""
        if peer in self._path_rtts:
            return self._path_rtts[peer] * 1000.0
        samples = self._rtts.get(peer)
        return min(samples) * 1000.0 if samples else None

    def rtt_source(self, peer: str) -> str | None:
        """Where :meth:`rtt_ms` comes from: "probe", "heartbeats", or None (not measured yet)."""
        return "probe" if peer in self._path_rtts else ("heartbeats" if self._rtts.get(peer) else None)

    def rtts_ms(self) -> dict[str, float]:
        return {p: v for p in self._rtts.keys() | self._path_rtts.keys() if (v := self.rtt_ms(p)) is not None}

    async def watch(self, period: float = DEFAULT_INTERVAL / 2) -> None:
        """Tick the detector forever (run in a nursery). A gap of STALL_S or more between two
        ticks means this process was stopped: its own silence is excused (nobody is declared
        lost for it) and ``on_stall`` is told."""
        self._stall_s = max(STALL_S, 4 * period)
        while True:
            self.tick()  # catches a stall first
            await trio.sleep(period)


async def run_ctl_link(
    fs: FramedStream,
    liveness: Liveness,
    outbox: trio.MemoryReceiveChannel[Advert],
    *,
    interval: float = DEFAULT_INTERVAL,
) -> None:
    """Our outbound ctl stream to ``fs.peer``: heartbeats every ``interval``, frames from
    ``outbox`` as they come, and RTT samples from the echoes. Returns never; raises PeerError
    when the stream dies (PeerLost) or a write stalls (PeerTimeout)."""
    peer = fs.peer
    sent: dict[int, float] = {}  # beat -> when we sent it (the last OUTSTANDING_BEATS)

    async def sender() -> None:
        beat = 0
        next_beat = trio.current_time()
        while True:
            advert: Advert | None = None
            with trio.move_on_at(next_beat):  # never cancel a send half-way: only the wait
                advert = await outbox.receive()
            if advert is not None:
                await fs.send_message(advert, timeout=interval * 4)
                continue
            beat += 1
            sent[beat] = trio.current_time()
            sent.pop(beat - OUTSTANDING_BEATS, None)
            await fs.send_message(Heartbeat(beat, _now_us()), timeout=interval * 4)
            next_beat = trio.current_time() + interval

    async def receiver() -> None:
        while True:
            # Silence is the failure detector's business; this deadline only reaps dead streams.
            # echoes only: anything else is a ProtocolError naming the peer and what came
            echo = await fs.receive_message(timeout=max(60.0, interval * 20), expect=Heartbeat)
            liveness.heard(peer)
            at = sent.pop(echo.seq, None)  # our own record: the echoed clock is not trusted
            if at is not None:
                liveness.rtt_sample(peer, trio.current_time() - at)

    failures: list[SwarmError] = []

    async def guarded(part: Callable[[], Awaitable[None]], nursery: trio.Nursery) -> None:
        try:
            await part()
        except SwarmError as exc:  # the first failure ends the link; raised bare below
            failures.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guarded, sender, nursery)
        nursery.start_soon(guarded, receiver, nursery)
    if failures:
        raise failures[0]


async def serve_ctl_inbound(
    fs: FramedStream,
    liveness: Liveness,
    on_advert: OnAdvert,
) -> None:
    """The peer's ctl stream to us: echo heartbeats, hand adverts to ``on_advert``. Returns when
    the peer closes the stream (PeerLost is swallowed: the link task reports deaths)."""
    peer = fs.peer
    while True:
        try:
            # silence is the failure detector's business; this deadline only reaps a stream left
            # half-way through a frame by a peer that went quiet
            msg = await fs.receive_message(timeout=max(10.0, DEFAULT_INTERVAL * 20))
        except PeerError:  # a ProtocolError (not a PeerError) ends the stream: see the caller
            return
        liveness.heard(peer)
        if isinstance(msg, Heartbeat):
            await fs.send_message(msg)
        elif isinstance(msg, Advert):
            await on_advert(peer, msg)
        else:
            raise ProtocolError(f"peer {peer} sent {message_name(msg)} on ctl (adverts and heartbeats only)")
