"""Membership: the signed-advert view, and the service on real libp2p hosts on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import trio

from swarm.errors import ProtocolError, UsageError
from swarm.manifest.identity import Identity
from swarm.net.host import open_host
from swarm.node.members.gossip import MemberEvent, MembershipService
from swarm.node.members.membership import Membership, detect_device
from swarm.planner import GB
from swarm.planner.peersfile import parse_peers_file
from swarm.proto.signed import sign_advert, verify_advert

SWARM = "0123456789abcdef0123456789abcdef"
SECRET = b"k" * 32
IDS = [Identity(bytes([i + 1]) * 32) for i in range(4)]
pytestmark = pytest.mark.timeout(60)


def _m(i: int, **kw: object) -> Membership:
    return Membership(IDS[i], SWARM, addrs=[f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{IDS[i].peer_id}"],
                      device=("cpu", "test cpu"), memory_bytes=(i + 1) << 30, ms_per_layer=1.5, first_seq=10, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_local_advert_is_signed_and_updates_bump_the_sequence() -> None:
    m = _m(0)
    verify_advert(m.local, SWARM)
    assert (m.local.peer_id, m.local.seq, m.local.memory_bytes, m.local.layer_us) == (IDS[0].peer_id, 10, 1 << 30, 1500)
    assert not m.update_local(memory_bytes=1 << 30)  # no change, no new advert
    assert m.update_local(rtt_ms={IDS[1].peer_id: 2.5, IDS[0].peer_id: 0.0})
    assert m.local.seq == 11 and m.local.rtt_us == {IDS[1].peer_id: 2500}
    verify_advert(m.local, SWARM)
    with pytest.raises(UsageError, match="memory"):
        m.update_local(memory_bytes=-1)
    assert m.update_local(held=([0, 1, 2, 5, 7, 8], True))
    assert m.local.held == {"0": 3, "5": 6, "7": 9} and m.local.held_head and m.local.seq == 12
    assert not m.update_local(held=([2, 1, 0, 8, 7, 5], True))
    assert m.update_local(held=([], False)) and m.local.held is None and m.local.held_head is None
    verify_advert(m.local, SWARM)
    assert m.update_local(disk=5 << 30) and m.local.disk == 5 << 30 and not m.update_local(disk=5 << 30)
    assert m.update_local(disk=-1) and m.local.disk is None  # unbounded: absent
    verify_advert(m.local, SWARM)


def test_the_peers_file_carries_what_each_peer_holds_and_its_disk() -> None:
    m = _m(0)
    assert m.update_local(held=([0, 1, 2, 7], True), disk=3 * GB)
    pf = m.peers_file()
    assert pf["peers"][0]["held"] == {"0": 3, "7": 8} and pf["peers"][0]["held_head"] is True  # type: ignore[index]
    (peer,) = parse_peers_file(pf).peers
    assert (peer.held, peer.held_head, peer.disk_bytes) == (frozenset({0, 1, 2, 7}), True, 3 * GB)
    (old,) = parse_peers_file(_m(1).peers_file()).peers  # an advert without them
    assert (old.held, old.held_head, old.disk_bytes) == (frozenset(), False, None)


def test_the_peers_file_carries_a_members_own_sessions() -> None:
    m = _m(0, sessions=2)
    assert m.local.sessions == 2
    verify_advert(m.local, SWARM)
    (peer,) = parse_peers_file(m.peers_file()).peers
    assert peer.sessions == 2
    other = _m(1)
    assert other.offer(m.local)  # a member's advert reaches the leader's view with its count
    by = {p.id: p for p in parse_peers_file(other.peers_file()).peers}
    assert by[IDS[0].peer_id].sessions == 2 and by[IDS[1].peer_id].sessions is None  # an advert without it


def test_the_peers_file_carries_a_members_width() -> None:
    m = _m(0, dtype_bytes=4)
    assert m.local.dtype_bytes == 4
    verify_advert(m.local, SWARM)
    other = _m(1)
    assert other.offer(m.local)
    by = {p.id: p for p in parse_peers_file(other.peers_file()).peers}
    assert by[IDS[0].peer_id].dtype_bytes == 4 and by[IDS[1].peer_id].dtype_bytes is None  # an advert without it


def test_view_keeps_latest_valid_advert_and_ignores_stale_and_forged() -> None:
    a, b = _m(0), _m(1)
    assert a.offer(b.local)
    old = b.local
    b.update_local(memory_bytes=5 << 30)
    assert a.offer(b.local)
    assert not a.offer(old)  # stale: lower sequence number
    assert not a.offer(b.local)  # repeated
    assert a.get(IDS[1].peer_id).memory_bytes == 5 << 30  # type: ignore[union-attr]
    forged = dataclasses.replace(b.local, seq=b.local.seq + 1, memory_bytes=1 << 50)
    with pytest.raises(ProtocolError, match="forged"):
        a.offer(forged)
    c = _m(2)
    impostor = sign_advert(dataclasses.replace(c.local, seq=99), IDS[2])
    impostor = dataclasses.replace(impostor, peer_id=IDS[1].peer_id)  # claims to be B
    with pytest.raises(ProtocolError, match="another peer's key"):
        a.offer(impostor)
    other_swarm = Membership(IDS[3], "f" * 32, device=("cpu", "x"), first_seq=1)
    with pytest.raises(ProtocolError, match="another swarm"):
        a.offer(other_swarm.local)
    assert not a.offer(a.local)  # our own advert relayed back
    assert a.get(IDS[1].peer_id).memory_bytes == 5 << 30  # type: ignore[union-attr]
    a.forget(IDS[1].peer_id)
    assert list(a.view()) == [IDS[0].peer_id]


def test_real_identities_filling_the_view_no_longer_lock_a_newcomer_out() -> None:
    """Issue 27: 256 real connected identities (one member holding the secret) filled every
    node's view and no newcomer could get in. A connected newcomer now takes the place of the
    peer the failure detector heard from least recently, never a member of the plan or the
    leader; an advert of a peer that never connected here takes nobody's place."""
    from swarm.proto.limits import DEFAULT_LIMITS

    me = _m(0)
    heard: dict[str, float] = {}
    honest = [_m(1), _m(2)]  # the plan's coordinator and stage; IDS[3] leads
    leader = Membership(IDS[3], SWARM, device=("cpu", "x"), first_seq=1)
    me.guard_book(pinned=lambda: {leader.peer_id, *(m.peer_id for m in honest)}, last_heard=heard.get)
    for t, m in enumerate([*honest, leader]):
        assert me.offer(m.local, now=float(t), connected=True)
        heard[m.peer_id] = float(t)  # heard from before anyone else
    sybils = [Membership(Identity(bytes([7, i % 256, i // 256]) + bytes(29)), SWARM, device=("cpu", "x"), first_seq=1)
              for i in range(DEFAULT_LIMITS.max_peers - 3)]  # fmt: skip
    for t, m in enumerate(sybils):
        assert me.offer(m.local, now=10.0 + t, connected=True)
        heard[m.peer_id] = 10.0 + t
    assert len(me.view()) == DEFAULT_LIMITS.max_peers + 1  # the book is full (we are not in it)
    made_up = Membership(Identity(b"m" * 32), SWARM, device=("cpu", "x"), first_seq=1)
    with pytest.raises(ProtocolError, match="not connected here"):
        me.offer(made_up.local, now=500.0, connected=False)
    newcomer = Membership(Identity(b"n" * 32), SWARM, device=("cpu", "x"), first_seq=1)
    assert me.offer(newcomer.local, now=500.0, connected=True)
    view = me.view()
    assert newcomer.peer_id in view and made_up.peer_id not in view
    assert sybils[0].peer_id not in view  # the one heard from least recently, not the plan's
    assert {leader.peer_id, *(m.peer_id for m in honest)} <= set(view)
    assert len(view) == DEFAULT_LIMITS.max_peers + 1


def test_peers_file_export_is_what_the_planner_reads() -> None:
    a, b = _m(0), _m(1)
    a.update_local(rtt_ms={IDS[1].peer_id: 3.0, "someone-gone": 9.0})
    b.update_local(rtt_ms={IDS[0].peer_id: 3.2})
    a.offer(b.local)
    out = a.peers_file()
    pf = parse_peers_file(out)
    assert sorted(p.id for p in pf.peers) == sorted([IDS[0].peer_id, IDS[1].peer_id])
    assert pf.rtt_ms == {IDS[0].peer_id: {IDS[1].peer_id: 3.0}, IDS[1].peer_id: {IDS[0].peer_id: 3.2}}
    peer_a = next(p for p in pf.peers if p.id == IDS[0].peer_id)
    assert peer_a.memory_bytes == 1 << 30 and peer_a.ms_per_layer == 1.5


def test_a_status_peers_file_lists_members_with_their_rtts_then_a_few_others_without() -> None:
    """``peers_file(members=..., others=N)`` (a status reply, which adverts made up by a member
    must not swell): the members and the RTTs among them, then at most N other adverts, no RTTs."""
    ms = [_m(i) for i in range(4)]
    ids = [m.peer_id for m in ms]
    for i, m in enumerate(ms):
        m.update_local(rtt_ms={q: 1.0 + i for q in ids if q != ids[i]})
    for m in ms[1:]:
        assert ms[0].offer(m.local)
    pf = parse_peers_file(ms[0].peers_file(members={ids[0], ids[1]}, others=1))
    listed = [p.id for p in pf.peers]
    assert sorted(listed[:2]) == sorted(ids[:2])  # the members first
    assert len(listed) == 3 and listed[2] in ids[2:]
    assert pf.rtt_ms == {ids[0]: {ids[1]: 1.0}, ids[1]: {ids[0]: 2.0}}  # among members only
    assert len(parse_peers_file(ms[0].peers_file(members={ids[0]}, others=0)).peers) == 1
    assert len(parse_peers_file(ms[0].peers_file()).peers) == 4  # no members given: the whole view


def test_an_offer_of_negative_memory_is_refused_at_construction() -> None:
    with pytest.raises(UsageError, match="memory offered must be >= 0 bytes, got -5"):
        Membership(IDS[0], SWARM, device=("cpu", "x"), memory_bytes=-5)


def test_detect_device_is_cheap_and_named() -> None:
    kind, name = detect_device()
    assert kind in ("cuda", "mps", "cpu") and 0 < len(name) <= 128


# ---------------------------------------------------------------- the service on real hosts


@contextlib.asynccontextmanager
async def _node(i: int, nursery: trio.Nursery, events: list[MemberEvent]) -> AsyncIterator[MembershipService]:
    async with open_host(IDS[i].seed, ["/ip4/127.0.0.1/tcp/0"], secret=SECRET, swarm_id=SWARM) as host:
        m = Membership(IDS[i], SWARM, addrs=host.addrs(), device=("cpu", f"node{i}"), memory_bytes=1 << 30)
        svc = MembershipService(host, m, on_event=events.append)
        async with trio.open_nursery() as inner:
            await inner.start(svc.run)
            try:
                yield svc
            finally:
                inner.cancel_scope.cancel()


async def _until(pred, timeout: float) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.05)


async def test_three_nodes_converge_then_a_dead_one_is_lost_and_rejoins_as_new_incarnation() -> None:
    ev: list[list[MemberEvent]] = [[], [], []]
    async with trio.open_nursery() as nursery, _node(0, nursery, ev[0]) as a, _node(1, nursery, ev[1]) as b:
        boot = a.host.addrs()[0]
        b.add_candidate(boot, "bootstrap")
        c_scope = trio.CancelScope()
        c_ready = trio.Event()
        c_box: list[MembershipService] = []

        async def run_c() -> None:
            with c_scope:
                async with _node(2, nursery, ev[2]) as c:
                    c.add_candidate(boot, "bootstrap")  # C knows only A: it learns B by gossip
                    c_box.append(c)
                    c_ready.set()
                    await trio.sleep_forever()

        nursery.start_soon(run_c)
        await c_ready.wait()
        c = c_box[0]
        svcs = (a, b, c)
        await _until(lambda: all(len(s.members()) == 2 and len(s.membership.view()) == 3 for s in svcs), 20)
        await _until(lambda: all(len(s.membership.peers_file()["rtt_ms"]) == 3 for s in svcs), 15)  # type: ignore[arg-type]
        pf = parse_peers_file(a.membership.peers_file())
        assert {p.id for p in pf.peers} == {s.host.peer_id for s in svcs}
        assert all(0 < v < 1000 for row in pf.rtt_ms.values() for v in row.values())
        assert any(e.kind == "joined" and e.peer == b.host.peer_id for e in ev[2])  # via gossip, then dialed

        # C dies (its host closes, like a killed process): A and B drop it within ~3 s.
        c_id = c.host.peer_id
        t0 = trio.current_time()
        c_scope.cancel()
        # members() drops C as soon as its connection closes (no longer admitted); its advert goes
        # from the view when the failure detector declares it lost: wait for both
        await _until(lambda: all(c_id not in s.members() and c_id not in s.membership.view() for s in (a, b)), 5)
        assert trio.current_time() - t0 < 3.5
        assert any(e.kind == "left" and e.peer == c_id for e in ev[0])

        # C comes back with the same key: a new incarnation everywhere.
        ev[2].clear()
        c_ready = trio.Event()
        c_box.clear()
        c_scope = trio.CancelScope()
        nursery.start_soon(run_c)
        await c_ready.wait()
        await _until(lambda: c_id in a.members() and c_id in b.members() and c_id in a.membership.view(), 30)
        rejoin = [e for e in ev[0] if e.kind == "rejoined" and e.peer == c_id]
        assert rejoin and rejoin[-1].incarnation == 1
        assert a.liveness.detector.incarnation(c_id) == 1
        nursery.cancel_scope.cancel()


async def test_a_hub_that_never_advertises_introduces_members_and_keeps_silent_clients() -> None:
    """The bootstrap's role: members that know only the hub learn of each other through it and
    dial each other; the hub is never a member, and a peer that speaks no ctl (a client, a
    `join --diagnose`) stays connected to it and is never reported by anyone."""
    ev: list[list[MemberEvent]] = [[], [], []]
    async with (
        trio.open_nursery() as nursery,
        open_host(IDS[0].seed, ["/ip4/127.0.0.1/tcp/0"], secret=SECRET, swarm_id=SWARM) as hub_host,
        _node(1, nursery, ev[1]) as b,
        _node(2, nursery, ev[2]) as c,
        open_host(IDS[3].seed, ["/ip4/127.0.0.1/tcp/0"], secret=SECRET, swarm_id=SWARM) as client,
    ):
        hub = MembershipService(hub_host, Membership(IDS[0], SWARM, memory_bytes=0), on_event=ev[0].append,
                                publish=False)  # fmt: skip
        await nursery.start(hub.run)
        boot = hub_host.addrs()[0]
        b.add_candidate(boot, "bootstrap")
        c.add_candidate(boot, "bootstrap")
        await client.dial(boot)
        await _until(lambda: b.members() == [c.host.peer_id] and c.members() == [b.host.peer_id], 20)
        assert b.host.is_admitted(c.host.peer_id)  # they dialed each other, learned by the hub's gossip
        assert sorted(hub.members()) == sorted([b.host.peer_id, c.host.peer_id])
        assert IDS[0].peer_id not in b.membership.view() and IDS[0].peer_id not in c.membership.view()
        await trio.sleep(3.5)  # past the failure detector's 2.5 s limit for a silent peer
        assert hub_host.is_admitted(client.peer_id)  # not dropped as silent
        assert all(e.peer in (b.host.peer_id, c.host.peer_id) for e in ev[0])
        assert all(e.peer != IDS[0].peer_id for e in ev[1] + ev[2])  # the hub never "joins"
        nursery.cancel_scope.cancel()


def test_the_leader_plans_a_member_with_the_sessions_its_advert_says() -> None:
    """The leader's view (its peers file, as Leader.plan_for reads it) plans a member that reserves
    two sessions with that room: more layers than the same member reserving the leader's eight,
    each block within its own predicted peak."""
    from swarm.planner import Latency, ModelSpec, plan
    from swarm.planner.budget import predicted_peak

    spec = ModelSpec(n_layers=12, layer_bytes=50 << 20, kv_bytes_per_token_per_layer=1 << 10, context_tokens=8192,
                     coordinator_bytes=100 << 20, sessions=8)  # fmt: skip
    leader = _m(1)  # 2 GiB at 1.5 ms a layer, reserving its own eight (no count in its advert)

    def member_layers(sessions: int | None) -> tuple[int, int]:
        view = _m(1)
        member = Membership(IDS[0], SWARM, device=("cpu", "test cpu"), memory_bytes=1 << 30, ms_per_layer=0.5,
                            first_seq=10, sessions=sessions)  # fmt: skip
        assert view.offer(member.local)
        pf = parse_peers_file(view.peers_file())
        got = plan(spec, list(pf.peers), Latency({IDS[0].peer_id: {IDS[1].peer_id: 2.0}}))
        s, e = got.blocks[IDS[0].peer_id]
        own = next(p for p in pf.peers if p.id == IDS[0].peer_id)
        assert predicted_peak(spec, (s, e), coordinator=got.coordinator == own.id, sessions=own.sessions) <= 1 << 30
        return e - s, predicted_peak(spec, (s, e), coordinator=False)

    (eight, _), (two, at_eight) = member_layers(8), member_layers(2)
    assert member_layers(None)[0] == eight == 8 and two == 12  # an advert without it: the leader's count
    assert at_eight > 1 << 30  # twelve layers would not fit at eight sessions
    assert leader.local.sessions is None

