"""RTT probes on the hops' path (swarm/node/members/probe.py): the echo protocol and what Liveness does
with the result. The real stack's probes: tests/node/test_ring_processes.py."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarm.errors import ProtocolError, SwarmError
from swarm.node.members.failure import PeerState
from swarm.node.members.heartbeat import Liveness
from swarm.node.members.probe import PINGS, echo_probe, probe_once
from swarm.node.ring.links import LocalLink
from swarm.proto import control as ctl
from swarm.proto.frame import Frame
from swarm.proto.messages import parse_message

PEER = "12D3KooWProbedPeer"


class End:
    """One end of an in-process duplex link; ``delays`` are how long each send takes in flight."""

    def __init__(self, out: LocalLink, inn: LocalLink, delays: list[float] | None = None) -> None:
        self.out, self.inn, self.delays, self.peer = out, inn, list(delays or []), PEER

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
