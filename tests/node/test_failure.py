"""Failure detector (pure, times as numbers) and heartbeats over in-memory streams on MockClock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarm.errors import UsageError
from swarm.net.streams import TrioStreamRaw, open_framed
from swarm.node.members.failure import MAX_PATIENCE, PATIENCE_DECAY_S, FailureDetector, PeerState
from swarm.node.members.heartbeat import RTT_SAMPLES, Liveness, run_ctl_link, serve_ctl_inbound
from swarm.proto.frame import Frame
from swarm.proto.messages import Advert

A, B = "peer-a", "peer-b"


def test_alive_suspect_lost_with_defaults_within_3s() -> None:
    fd = FailureDetector()
    [t] = fd.heard(A, 10.0)
    assert (t.old, t.new, t.incarnation) == (None, PeerState.ALIVE, 0)
    assert fd.tick(11.0) == []
    [s] = fd.tick(11.3)
    assert s.new is PeerState.SUSPECT
    assert fd.tick(12.0) == []  # no duplicate transition
    [lost] = fd.tick(12.5)
    assert lost.new is PeerState.LOST and lost.at - 10.0 <= 3.0
    assert fd.tick(20.0) == []
    assert fd.live_peers() == []


def test_slow_but_live_peer_is_never_suspected() -> None:
    fd = FailureDetector()
    now = 0.0
    fd.heard(A, now)
    for _ in range(200):  # beats arrive every 1.2 s instead of 0.5 s: slow, but alive
        now += 1.2
        assert fd.tick(now - 0.01) == []
        assert fd.heard(A, now) == []
    assert fd.state(A) is PeerState.ALIVE


def test_suspect_peer_that_speaks_is_alive_again_same_incarnation() -> None:
    fd = FailureDetector()
    fd.heard(A, 0.0)
    fd.tick(1.5)
    assert fd.state(A) is PeerState.SUSPECT
    [t] = fd.heard(A, 1.6)
    assert (t.old, t.new, t.incarnation, t.rejoined) == (PeerState.SUSPECT, PeerState.ALIVE, 0, False)


def test_lost_peer_returns_as_new_incarnation() -> None:
    fd = FailureDetector()
    fd.heard(A, 0.0)
    [t] = fd.declare_lost(A, 0.2, "stream closed")
    assert t.new is PeerState.LOST and t.reason == "stream closed"
    assert fd.declare_lost(A, 0.3, "again") == []
    [back] = fd.heard(A, 5.0)
    assert back.rejoined and back.incarnation == 1
    fd.tick(10.0)
    [again] = fd.heard(A, 11.0)
    assert again.incarnation == 2


def test_a_peer_that_was_slow_not_gone_gets_more_patience_each_time() -> None:
    """Re-plans are rate-limited per peer: a peer lost for silence that comes back must be silent
    twice as long to be lost again (up to MAX_PATIENCE), and the reason says so."""
    fd = FailureDetector()
    fd.heard(A, 0.0)
    [lost] = [t for t in fd.tick(2.5) if t.new is PeerState.LOST]
    assert "allowed 2.5 s" in lost.reason and "allowed 5.0 s" in lost.reason and "rate-limited" in lost.reason
    [back] = fd.heard(A, 3.0)
    assert back.rejoined and "slow, not gone" in back.reason and fd.patience(A) == 2.0
    assert [t.new for t in fd.tick(3.0 + 2.6)] == [PeerState.SUSPECT]  # 2.6 s of silence: only suspect now
    [lost2] = [t for t in fd.tick(3.0 + 5.0) if t.new is PeerState.LOST]
    assert "allowed 5.0 s" in lost2.reason
    t = 8.0
    for _ in range(4):  # each return doubles it, up to the cap
        t += 0.5
        fd.heard(A, t)
        t += 2.5 * fd.patience(A)
        fd.tick(t)
    assert fd.patience(A) == MAX_PATIENCE
    fd.heard(A, t)
    for k in range(1, 4):  # alive a minute: halved each time, back to the defaults
        fd.heard(A, t + k * PATIENCE_DECAY_S)
        fd.tick(t + k * PATIENCE_DECAY_S)
    assert fd.patience(A) == 1.0


def test_a_closed_connection_is_gone_at_once_and_earns_no_patience() -> None:
    fd = FailureDetector()
    fd.heard(A, 0.0)
    [lost] = fd.declare_lost(A, 1.0, "connection closed")
    assert lost.new is PeerState.LOST
    [back] = fd.heard(A, 2.0)
    assert back.rejoined and fd.patience(A) == 1.0
    assert [t.new for t in fd.tick(2.0 + 2.5)][-1] is PeerState.LOST


def test_out_of_order_reports_and_bad_config() -> None:
    fd = FailureDetector()
    fd.heard(A, 5.0)
    assert fd.heard(A, 4.0) == []
    assert fd.last_heard(A) == 5.0
    assert fd.next_deadline(5.0) == pytest.approx(5.0 + fd.suspect_after)
    with pytest.raises(UsageError, match="suspect_after"):
        FailureDetector(suspect_after=3.0, lost_after=2.0)


# ---------------------------------------------------------------- heartbeats on MockClock


async def _pair(nursery: trio.Nursery, liv_a: Liveness, liv_b: Liveness, outbox: trio.MemoryReceiveChannel[Frame],
                adverts: list[Advert], stop_b: trio.CancelScope) -> None:  # fmt: skip
    """A's outbound ctl link to B over an in-memory stream; B serves it (until stop_b)."""
    left, right = trio.testing.memory_stream_pair()

    async def side_a() -> None:
        async with open_framed(TrioStreamRaw(left), peer=B, protocol="ctl") as fs:
            await run_ctl_link(fs, liv_a, outbox, interval=0.5)

    async def on_advert(peer: str, adv: Advert) -> None:
        adverts.append(adv)

    async def side_b() -> None:
        async with open_framed(TrioStreamRaw(right), peer=A, protocol="ctl") as fs:
            with stop_b:
                await serve_ctl_inbound(fs, liv_b, on_advert)
            await trio.sleep_forever()  # frozen: the stream stays open, nothing is answered

    nursery.start_soon(side_a)
    nursery.start_soon(side_b)


@pytest.mark.trio
async def test_heartbeats_keep_peer_alive_then_frozen_peer_is_lost_within_3s(autojump_clock: trio.testing.MockClock) -> None:
    events: list[tuple[str, PeerState, float]] = []
    liv_a = Liveness(on_transition=lambda t: events.append((t.peer, t.new, trio.current_time())))
    liv_b = Liveness()
    _, outbox = trio.open_memory_channel[Frame](8)
    frozen = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(liv_a.watch, 0.25)
        liv_a.heard(B)
        await _pair(nursery, liv_a, liv_b, outbox, [], frozen)
        await trio.sleep(30.0)  # 30 s of virtual time: alive throughout, RTT measured
        assert [e[1] for e in events] == [PeerState.ALIVE]
        assert liv_a.rtt_ms(B) is not None and liv_a.rtt_ms(B) < 1.0
        assert liv_b.state(A) is PeerState.ALIVE
        # B freezes: it stops reading and answering, but its stream stays open (like SIGSTOP).
        t_freeze = trio.current_time()
        frozen.cancel()
        await trio.sleep(5.0)
        lost = [e for e in events if e[1] is PeerState.LOST]
        assert lost, events
        assert lost[0][2] - t_freeze <= 3.0
        assert PeerState.SUSPECT in [e[1] for e in events]
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_slow_heartbeat_link_is_not_lost(autojump_clock: trio.testing.MockClock) -> None:
    """Beats every 1.0 s (twice the default interval, e.g. a busy peer): never suspect."""
    events: list[PeerState] = []
    liv_a = Liveness(on_transition=lambda t: events.append(t.new))
    left, right = trio.testing.memory_stream_pair()
    _, outbox = trio.open_memory_channel[Frame](8)

    async def on_advert(peer: str, adv: Advert) -> None:
        return None

    async def side_a() -> None:
        async with open_framed(TrioStreamRaw(left), peer=B, protocol="ctl") as fs:
            await run_ctl_link(fs, liv_a, outbox, interval=1.0)

    async def side_b() -> None:
        async with open_framed(TrioStreamRaw(right), peer=A, protocol="ctl") as fs:
            await serve_ctl_inbound(fs, Liveness(), on_advert)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(liv_a.watch, 0.25)
        nursery.start_soon(side_a)
        nursery.start_soon(side_b)
        await trio.sleep(60.0)
        assert events == [PeerState.ALIVE]
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_our_own_stall_excuses_the_others_silence(mock_clock: trio.testing.MockClock) -> None:
    """A process stopped for 5 s (SIGSTOP, a laptop asleep) wakes to find everyone silent: that
    is its own doing, so nobody is declared lost for it and ``on_stall`` is told the gap. The
    same silence while our loop keeps ticking does lose the peer."""
    events: list[PeerState] = []
    stalls: list[float] = []
    liv = Liveness(on_transition=lambda t: events.append(t.new), on_stall=stalls.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(liv.watch, 0.25)
        liv.heard(B)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(5.0)  # our loop did not run for 5 s
        await trio.testing.wait_all_tasks_blocked()
        assert len(stalls) == 1 and 5.0 <= stalls[0] < 5.5
        assert events == [PeerState.ALIVE] and liv.state(B) is PeerState.ALIVE
        mock_clock.autojump_threshold = 0  # now time passes with our loop running
        await trio.sleep(5.0)
        assert events[-1] is PeerState.LOST and len(stalls) == 1
        nursery.cancel_scope.cancel()


def test_rtt_is_the_idle_links_round_trip() -> None:
    """Round trips taken while a peer's loop was busy (loading, computing) are longer, never
    shorter: the estimate is the least of the last RTT_SAMPLES, and a link that really got slower
    shows within that many beats."""
    liv = Liveness()
    for s in (0.030, 0.0004, 0.025, 0.012, 0.0006):  # a loaded loop's round trips among idle ones
        liv.rtt_sample(B, s)
    assert liv.rtt_ms(B) == pytest.approx(0.4) and liv.rtts_ms() == {B: pytest.approx(0.4)}
    for _ in range(RTT_SAMPLES):
        liv.rtt_sample(B, 0.020)  # the route changed: 20 ms from now on
    assert liv.rtt_ms(B) == pytest.approx(20.0)
    liv.rtt_sample(B, -0.001)  # a clock step: ignored
    assert liv.rtt_ms(B) == pytest.approx(20.0) and liv.rtt_ms(A) is None
