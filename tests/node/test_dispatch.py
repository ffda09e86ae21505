"""Requests between peers on /shard-swarm/ring/1 (node/dispatch.py ``RingClient``) over the
in-memory network on a mock clock: a request to oneself never opens a stream, a reply comes back
typed, what a handler raises travels as a typed Fail, a malformed request is answered (not
dropped), and the set-up phases wait for every peer but never for a standby, failing with the
first peer's typed error. The role table itself is tested in test_authority.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import CannotServe, PeerError, PlanningError, ProtocolError
from swarm.node.dispatch import Dispatcher, Handlers, RingClient
from swarm.proto import control as ctl
from swarm.proto.frame import Frame, MsgType
from swarm.proto.limits import PROTO_RING
from swarm.proto.messages import Message, parse_message
from swarm.testing.memnet import MemHost, MemNet

SECRET, SWARM = b"k" * 32, "friends"


class _View:
    """Every admitted peer a member; the first host leads."""

    def __init__(self, host: MemHost, leader: str) -> None:
        self.peer_id, self.host, self._leader = host.peer_id, host, leader

    def admitted_role(self, peer: str) -> str | None:
        return self.host.admitted_role(peer)

    def members(self) -> list[str]:
        return sorted({self.peer_id, *self.host.admitted_peers()})

    def leader(self) -> str:
        return self._leader


class _Peer:
    """A host with a ring client whose handlers answer ``Ended`` and ``Current`` as told."""

    def __init__(self, host: MemHost, leader: str, current: str) -> None:
        self.host = host
        self.heard: list[tuple[str, Message]] = []
        self.current = current  # "ack", "refuse" (a planning error) or "hang"
        handlers = {ctl.Ended: self._ended, ctl.Current: self._current}
        local = Dispatcher(_View(host, leader), lambda epoch: (None, set()), handlers, "ring")  # type: ignore[arg-type]
        self.ring = RingClient(host, host.peer_id, local, rpc_timeout=3.0)
        host.handle(PROTO_RING, self.ring.serve)

    async def _ended(self, peer: str, msg: Any) -> Message:
        self.heard.append((peer, msg))
        return ctl.Ack()

    async def _current(self, peer: str, msg: Any) -> Message:
        self.heard.append((peer, msg))
        if self.current == "refuse":
            raise PlanningError("the live members are 2.0 GB short")
        if self.current == "hang":
            await trio.sleep_forever()
        return ctl.NoPlan()


@contextlib.asynccontextmanager
async def _swarm(*currents: str) -> AsyncIterator[list[_Peer]]:
    """Peers (the first leads) all connected to the first, each answering Current as told."""
    net = MemNet()
    async with contextlib.AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(net.open_host(bytes([i + 1]) * 32, secret=SECRET, swarm_id=SWARM))
                 for i in range(len(currents))]  # fmt: skip
        peers = [_Peer(h, hosts[0].peer_id, c) for h, c in zip(hosts, currents, strict=True)]
        for h in hosts[1:]:
            await hosts[0].dial(h.addrs()[0])
        yield peers


async def test_a_request_to_oneself_is_dispatched_in_process(autojump_clock: trio.testing.MockClock) -> None:
    async with _swarm("ack") as (a,):
        reply = await a.ring.call(a.host.peer_id, ctl.Ended(4))
    assert isinstance(reply, ctl.Ack) and a.heard == [(a.host.peer_id, ctl.Ended(4))]


async def test_a_reply_comes_back_typed_and_a_handlers_error_as_its_typed_fail(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _swarm("ack", "refuse") as (a, b):
        assert isinstance(await a.ring.call(b.host.peer_id, ctl.Ended(7)), ctl.Ack)
        fail = await a.ring.call(b.host.peer_id, ctl.Current())
        assert b.heard == [(a.host.peer_id, ctl.Ended(7)), (a.host.peer_id, ctl.Current())]
    assert isinstance(fail, ctl.Fail) and fail.code == "cannot_serve"
    assert isinstance(fail.error(), CannotServe) and "2.0 GB short" in str(fail.error())


async def test_a_malformed_request_is_answered_with_a_fail(autojump_clock: trio.testing.MockClock) -> None:
    async with _swarm("ack", "ack") as (a, b):
        async with a.host.open_stream(b.host.peer_id, PROTO_RING, timeout=5) as fs:
            await fs.send(Frame(MsgType.CONTROL, meta={"op": "no-such-op"}))
            reply = parse_message(await fs.receive(timeout=5))
        assert b.heard == []
    assert isinstance(reply, ctl.Fail) and reply.code == "bad_request"


async def test_a_phase_collects_every_reply_and_tells_standbys_without_failing_on_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _swarm("ack", "ack", "ack", "refuse") as (a, b, c, standby):
        ids = [p.host.peer_id for p in (b, c)]
        replies = await a.ring.phase(ids, ctl.Current(), ctl.NoPlan, timeout=5, best_effort=[standby.host.peer_id])
        assert standby.heard  # told ...
    assert sorted(replies) == sorted(ids) and all(isinstance(r, ctl.NoPlan) for r in replies.values())  # ... not counted


async def test_a_phase_fails_with_a_peers_typed_refusal(autojump_clock: trio.testing.MockClock) -> None:
    async with _swarm("ack", "ack", "refuse") as (a, b, c):
        with pytest.raises(CannotServe, match=f"peer {c.host.peer_id} refused current: the live members"):
            await a.ring.phase([b.host.peer_id, c.host.peer_id], ctl.Current(), ctl.NoPlan, timeout=5)


async def test_a_phase_gives_up_on_a_silent_peer_after_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with _swarm("ack", "hang") as (a, b):
        t0 = trio.current_time()
        with pytest.raises(PeerError):
            await a.ring.phase([b.host.peer_id], ctl.Current(), ctl.NoPlan, timeout=4)
        assert 4 <= trio.current_time() - t0 < 4 + 5  # the reply's bound, within the phase's own


async def test_a_phase_answer_of_the_wrong_kind_is_a_protocol_error(autojump_clock: trio.testing.MockClock) -> None:
    async with _swarm("ack", "ack") as (a, b):
        with pytest.raises(ProtocolError, match="answered ended with .*expected linked"):
            await a.ring.phase([b.host.peer_id], ctl.Ended(2), ctl.Linked, timeout=5)


def test_a_handlers_table_takes_declared_types_once_and_nothing_after_its_seal() -> None:
    async def answer(peer: str, msg: Any) -> Message:
        return ctl.Ack()

    table = Handlers({ctl.Leaving: answer})
    with pytest.raises(TypeError, match=r"a second handler for \['Leaving'\]"):
        table.add({ctl.Leaving: answer})
    with pytest.raises(TypeError, match=r"no role declared for \['Done'\]"):
        table.add({ctl.Done: answer})
    table.add({ctl.Leave: answer})
    table.seal()
    with pytest.raises(TypeError, match=r"handlers for \['Fault'\] added after the seal"):
        table.add({ctl.Fault: answer})
    assert dict(table) == {ctl.Leaving: answer, ctl.Leave: answer}
