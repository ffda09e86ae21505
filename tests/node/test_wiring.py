"""An epoch's hops at one peer (node/plan/wiring.py), on a mock clock: what an activation stream
into this node must open with (a hop hello from that hop's upstream in the current epoch, or a
path probe, which is echoed), that a taken hop becomes the epoch's inbound link until the epoch
ends, and the leader's probe of a member's activation door over the in-memory network (answered,
silent, or not served). Whole set-ups: test_swarm_mem.py; the fast path's: test_ring_processes.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from swarm.errors import ProtocolError
from swarm.node.members.probe import PINGS, probe_once
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.plan.wiring import Wiring, door_open
from swarm.node.ring.capacity import SlotQueue
from swarm.node.ring.links import LocalLink
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto import control as ctl
from swarm.proto.frame import Frame
from swarm.proto.limits import DEFAULT_LIMITS, PROTO_ACT
from swarm.proto.messages import MessageIO, parse_message
from swarm.testing.memnet import MemHost, MemNet

SECRET, SWARM = b"k" * 32, "friends"


def _wiring(me: str, host: object, nursery: trio.Nursery, plan: Plan | None = None) -> tuple[Wiring, Epochs]:
    settings = NodeSettings(seed=b"s" * 32, swarm_id=SWARM, secret=SECRET, model_dir=None)
    epochs = Epochs(settings, me, None, SlotQueue(), Notices(Hooks()), leader=lambda: "L", memory=dict)  # type: ignore[arg-type]
    if plan is not None:
        epochs.current = Epoch(plan, b"")
    wiring = Wiring(me, host, None, epochs, None, Notices(Hooks()), nursery,  # type: ignore[arg-type]
                    report_fault=lambda *a: None, offered=lambda: 0)  # fmt: skip
    return wiring, epochs


class _Duplex(MessageIO):
    """Both directions of one stream as a link to ``serve_act`` and a link to the test."""

    def __init__(self) -> None:
        self.up, self.down = LocalLink("in"), LocalLink("out")
        self.peer, self.limits = "upstream", DEFAULT_LIMITS

    async def send(self, frame: Frame, timeout: float | None = None) -> None:
        await self.down.send(frame, timeout)

    async def receive(self, timeout: float | None = None) -> Frame:
        return await self.up.receive(timeout)


PLAN = Plan(5, 6, "C", ("A", "B"), {"A": (0, 3), "B": (3, 6)}, (), 1.0, 1.0)  # hops: C->A, A->B, B->C


async def test_a_hop_from_its_upstream_is_the_epochs_inbound_link_until_the_epoch_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        wiring, epochs = _wiring("B", None, nursery, PLAN)
        ep = epochs.current
        assert ep is not None
        stream = _Duplex()
        held = trio.Event()

        async def serve() -> None:
            await wiring.serve_act("A", stream, hello=ctl.Hop(5, 1))  # type: ignore[arg-type]
            held.set()

        nursery.start_soon(serve)
        await trio.sleep(1)
        assert ep.wait_inbound(1).is_set() and ep.inbound[1] is stream and not held.is_set()
        epochs.end("lost C")
        await trio.sleep(0.1)
        assert held.is_set()  # the stream is let go once its epoch ends


@pytest.mark.parametrize(
    ("peer", "hello", "why"),
    [
        ("C", ctl.Hop(5, 1), "peer C does not send hop 1 to B in epoch 5"),  # C's hop enters A, not B
        ("A", ctl.Hop(5, 9), "does not send hop 9"),
        ("A", ctl.Hop(4, 1), "epoch 4 is not current here"),
        ("A", ctl.Ack(), "activation stream must start with a hop hello"),
    ],
)
async def test_an_activation_stream_that_does_not_open_as_a_hop_of_ours_is_refused(
    peer: str, hello: ctl.Control, why: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        wiring, epochs = _wiring("B", None, nursery, PLAN)
        stream = _Duplex()
        await stream.up.send(hello.to_frame())
        with pytest.raises(ProtocolError, match=why):
            await wiring.serve_act(peer, stream)  # type: ignore[arg-type]
        assert epochs.current is not None and epochs.current.inbound == {}


async def test_a_probe_hello_is_echoed_and_the_stream_closed(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        wiring, _ = _wiring("B", None, nursery)  # no epoch needed to measure a path
        stream = _Duplex()
        far = _Duplex()
        far.up, far.down = stream.down, stream.up  # the other end of the same stream
        far.peer = "B"  # type: ignore[attr-defined]
        await stream.up.send(ctl.Probe(7).to_frame())
        done = trio.Event()

        async def serve() -> None:
            await wiring.serve_act("A", stream)  # type: ignore[arg-type]
            done.set()

        nursery.start_soon(serve)
        assert parse_message(await far.receive(timeout=5)) == ctl.Probe(7)  # type: ignore[arg-type]
        assert await probe_once(far, pings=PINGS - 1) >= 0  # PINGS more, each echoed ...
        await trio.sleep(0.1)
        assert done.is_set()  # ... and then it returns


@contextlib.asynccontextmanager
async def _pair(nursery: trio.Nursery) -> AsyncIterator[tuple[MemNet, MemHost, MemHost, Wiring]]:
    net = MemNet()
    async with net.open_host(b"\1" * 32, secret=SECRET, swarm_id=SWARM) as a, \
            net.open_host(b"\2" * 32, secret=SECRET, swarm_id=SWARM) as b:  # fmt: skip
        await a.dial(b.addrs()[0])
        leader, _ = _wiring(a.peer_id, a, nursery)
        yield net, a, b, leader


async def test_the_leaders_probe_of_a_members_door(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        async with _pair(nursery) as (net, a, b, leader):
            assert not await door_open(a, None, b.peer_id, timeout=3)  # nothing serves act/1 there
            member, _ = _wiring(b.peer_id, b, nursery)
            b.handle(PROTO_ACT, member.serve_act)
            assert await door_open(a, None, b.peer_id, timeout=3)
            net.freeze(b.peer_id)
            t0 = trio.current_time()
            assert not await door_open(a, None, b.peer_id, timeout=3)  # silent: false at the timeout
            assert trio.current_time() - t0 == pytest.approx(3, abs=0.1)
        nursery.cancel_scope.cancel()
