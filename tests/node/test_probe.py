"""RTT probes on the hops' path (swarm/node/members/probe.py): the echo protocol and what Liveness does
with the result. The real stack's probes: tests/node/test_ring_processes.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from swarm.errors import PeerLost, ProtocolError, SwarmError
from swarm.node.members.failure import PeerState
from swarm.node.members.heartbeat import Liveness
from swarm.node.members.probe import (
    PERIOD_S,
    PINGS,
    POLL_S,
    TIMEOUT_S,
    Prober,
    echo_probe,
    probe_once,
)
from swarm.node.ring.links import LocalLink
from swarm.proto import control as ctl
from swarm.proto.frame import Frame
from swarm.proto.limits import DEFAULT_LIMITS
from swarm.proto.messages import MessageIO, parse_message

PEER = "12D3KooWProbedPeer"


class End(MessageIO):
    """One end of an in-process duplex link; ``delays`` are how long each send takes in flight."""

    def __init__(self, out: LocalLink, inn: LocalLink, delays: list[float] | None = None) -> None:
        self.out, self.inn, self.delays, self.peer = out, inn, list(delays or []), PEER
        self.limits = DEFAULT_LIMITS

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        if self.delays:
            await trio.sleep(self.delays.pop(0))
        await self.out.send(frame, timeout)

    async def receive(self, timeout: float | None = None) -> Frame:
        return await self.inn.receive(timeout)


def _pair(delays: list[float]) -> tuple[End, End]:
    a2b, b2a = LocalLink("a->b"), LocalLink("b->a")
    return End(a2b, b2a), End(b2a, a2b, delays)


async def _serve(end: End) -> None:
    """What Wiring.serve_act does with a channel whose hello is a probe."""
    hello = parse_message(await end.receive())
    assert isinstance(hello, ctl.Probe)
    await echo_probe(end, PEER, hello)


async def test_the_least_round_trip_is_the_rtt(autojump_clock: trio.testing.MockClock) -> None:
    prober, echoer = _pair([0.030, 0.004, 0.012, 0.0005, 0.020, 0.009])  # a busy loop delays some echoes
    async with trio.open_nursery() as n:
        n.start_soon(_serve, echoer)
        assert await probe_once(prober) == pytest.approx(0.0005)


async def test_a_wrong_echo_fails_the_probe(autojump_clock: trio.testing.MockClock) -> None:
    prober, echoer = _pair([])

    async def liar() -> None:
        for _ in range(2):
            got = parse_message(await echoer.receive())
            assert isinstance(got, ctl.Probe)
            await echoer.send(ctl.Probe(got.nonce ^ 1).to_frame())

    async with trio.open_nursery() as n:
        n.start_soon(liar)
        with pytest.raises(SwarmError, match="not the ping just sent"):
            await probe_once(prober)
        n.cancel_scope.cancel()


async def test_echoes_sent_ahead_of_their_pings_fail_the_probe(autojump_clock: trio.testing.MockClock) -> None:
    """A member that wants a short RTT (to be planned as a neighbour, or as the coordinator)
    cannot echo pings before they arrive: the nonces are random."""
    prober, echoer = _pair([])
    for guess in range(PINGS + 1):
        await echoer.send(ctl.Probe(guess).to_frame())
    with pytest.raises(SwarmError, match="not the ping just sent"):
        await probe_once(prober)


async def test_the_echo_refuses_anything_but_probes_and_stops_after_pings(autojump_clock: trio.testing.MockClock) -> None:
    prober, echoer = _pair([])
    await prober.send(ctl.Hop(1, 0).to_frame())  # buffered: the echo reads it after sending the hello back
    with pytest.raises(ProtocolError, match="probe channel carried Hop"):
        await echo_probe(echoer, PEER, ctl.Probe(0))
    # a prober that pings on and on gets PINGS echoes after the hello's, then nothing
    prober, echoer = _pair([])
    async with trio.open_nursery() as n:
        n.start_soon(echo_probe, echoer, PEER, ctl.Probe(0))
        await prober.receive()
        for seq in range(1, PINGS + 1):
            await prober.send(ctl.Probe(seq).to_frame())
            assert parse_message(await prober.receive()) == ctl.Probe(seq)
        await prober.send(ctl.Probe(PINGS + 1).to_frame())
        with pytest.raises(SwarmError, match="nothing received"):
            await prober.receive(timeout=5)


def test_a_probed_rtt_replaces_the_heartbeats_until_the_peer_is_lost() -> None:
    liv = Liveness(clock=lambda: 0.0)
    liv.path_rtt(PEER, 0.0001)  # an unknown peer: ignored
    assert liv.rtt_ms(PEER) is None and liv.rtt_source(PEER) is None
    liv.heard(PEER)
    liv.rtt_sample(PEER, 0.002)
    assert liv.rtt_ms(PEER) == pytest.approx(2.0) and liv.rtt_source(PEER) == "heartbeats"
    liv.path_rtt(PEER, 0.0002)
    assert liv.rtt_ms(PEER) == pytest.approx(0.2) and liv.rtt_source(PEER) == "probe"
    assert liv.rtts_ms() == {PEER: pytest.approx(0.2)}
    liv.lost(PEER, "test")
    assert liv.state(PEER) is PeerState.LOST
    assert liv.rtt_ms(PEER) is None and liv.rtts_ms() == {}


# ---------------------------------------------------------------- the prober's schedule


class _EchoChannel:
    """A fast channel (what ``fastpath.dial`` returns) whose other end echoes every message
    after ``rtt`` seconds."""

    def __init__(self, peer: str, rtt: float) -> None:
        self.remote_peer, self.path, self.rtt = peer, "direct", rtt
        self._send, self._recv = trio.open_memory_channel[bytes](16)
        self.closed = False

    async def send(self, data: bytes, timeout: float | None = None) -> None:
        await trio.sleep(self.rtt)
        await self._send.send(data)

    async def receive(self, timeout: float | None = None) -> bytes:
        return await self._recv.receive()

    async def aclose(self) -> None:
        self.closed = True


class _FastPath:
    """Dials: a channel with that peer's RTT; a peer in ``down`` has no fast path (yet)."""

    def __init__(self, rtts: dict[str, float]) -> None:
        self.rtts, self.down = rtts, set[str]()
        self.dials: list[tuple[float, str]] = []
        self.channels: list[_EchoChannel] = []

    async def dial(self, peer: str, timeout: float) -> _EchoChannel:
        self.dials.append((trio.current_time(), peer))
        if peer in self.down:
            raise PeerLost(f"no fast path to {peer}")
        ch = _EchoChannel(peer, self.rtts[peer])
        self.channels.append(ch)
        return ch


class _Service:
    def __init__(self, memory: dict[str, int]) -> None:
        self.memory = memory
        self.membership = SimpleNamespace(view=lambda: {p: SimpleNamespace(memory_bytes=m) for p, m in self.memory.items()})
        self.liveness = SimpleNamespace(path_rtt=lambda peer, rtt: self.rtts.append((peer, rtt)))
        self.rtts: list[tuple[str, float]] = []

    def members(self) -> list[str]:
        return list(self.memory)


async def test_members_holding_a_model_are_probed_once_a_period_and_failures_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service = _Service({"A": 1 << 30, "B": 1 << 30, "client-like": 0})
    fast = _FastPath({"A": 0.002, "B": 0.010})
    fast.down.add("B")
    prober = Prober(service, fast)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prober.run)
        await trio.sleep(1)
        assert sorted(p for _, p in fast.dials) == ["A", "B"]  # a member offering no memory is never probed
        assert service.rtts == [("A", pytest.approx(0.002))] and all(ch.closed for ch in fast.channels)
        fast.down.clear()
        await trio.sleep(PERIOD_S / 2)
        assert len(fast.dials) == 2  # nobody again before the period, not even the failed one
        await trio.sleep(PERIOD_S / 2)
        assert sorted(p for _, p in fast.dials[2:]) == ["A", "B"]
        assert ("B", pytest.approx(0.010)) in service.rtts  # retried a period later, on the path it now has
        del service.memory["B"]  # B left: forgotten, never probed again
        await trio.sleep(2 * PERIOD_S)
        assert {p for _, p in fast.dials[4:]} == {"A"}
        nursery.cancel_scope.cancel()
    assert [t for t, p in fast.dials if p == "A"] == pytest.approx([0, PERIOD_S, 2 * PERIOD_S, 3 * PERIOD_S], abs=POLL_S + 0.1)


async def test_a_probe_that_hangs_ends_at_its_bound_and_the_rtt_stays_the_heartbeats(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A dial that never completes (a path that blackholes) is cut at the probe's overall bound;
    the prober goes on and the next period's probe measures the path."""
    service = _Service({"A": 1 << 30})
    fast = _FastPath({"A": 0.004})
    real_dial, hung = fast.dial, list[float]()

    async def dial(peer: str, timeout: float) -> _EchoChannel:
        if not hung:
            hung.append(trio.current_time())
            await trio.sleep_forever()
        return await real_dial(peer, timeout)

    fast.dial = dial  # type: ignore[method-assign]
    prober = Prober(service, fast)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prober.run)
        await trio.sleep(TIMEOUT_S * (PINGS + 2) + 1)
        assert service.rtts == [] and prober._running == set()  # given up, not stuck
        await trio.sleep(PERIOD_S)
        nursery.cancel_scope.cancel()
    assert service.rtts == [("A", pytest.approx(0.004))]
