"""Our own errors out of trio's exception groups (node/errors_util.py): a lone leaf is unwrapped
however deep, also beside an enclosing scope's Cancelled; a group of several stays a group; the
first error of a kind is found anywhere."""

from __future__ import annotations

import trio

from swarm.errors import PeerLost, PeerTimeout, ProtocolError, SwarmError
from swarm.node.errors_util import first_leaf, unwrap


def test_a_lone_leaf_is_unwrapped_however_deep() -> None:
    lost = PeerLost("hop 2 closed")
    assert unwrap(ExceptionGroup("outer", [ExceptionGroup("inner", [lost])])) is lost
    assert unwrap(lost) is lost
    both = ExceptionGroup("two", [lost, PeerTimeout("slow")])
    assert unwrap(ExceptionGroup("outer", [both])) is both  # several errors: the group, not a guess


async def test_an_error_beside_an_enclosing_cancel_comes_out_alone_and_the_cancel_still_stops() -> None:
    """A node leaving (its nursery cancelled) while a link task fails (the tail left first): the
    inner nursery raises [Cancelled, PeerLost]. The boundary that catches SwarmError must get
    the PeerLost (a group escaped and crashed the node at exit, in a stress run here), and the
    task still stops at its next checkpoint."""
    seen: list[str] = []

    async def link() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise PeerLost("tail closed the connection") from None

    async def boundary() -> None:
        try:
            try:
                async with trio.open_nursery() as inner:
                    inner.start_soon(trio.sleep_forever)
                    await link()
            except BaseExceptionGroup as eg:
                raise unwrap(eg) from None
        except SwarmError as exc:
            seen.append(f"handled: {exc}")
        await trio.sleep(0)  # cancelled still
        seen.append("kept running")

    async with trio.open_nursery() as node:
        node.start_soon(boundary)
        await trio.sleep(0.01)
        node.cancel_scope.cancel()
    assert seen == ["handled: tail closed the connection"]


def test_the_first_error_of_a_kind_is_found_anywhere_in_a_group() -> None:
    bad = ProtocolError("forged plan")
    eg = ExceptionGroup("outer", [ValueError("a bug"), ExceptionGroup("inner", [KeyError("k"), bad, PeerLost("x")])])
    assert first_leaf(eg, ProtocolError) is bad
    assert isinstance(first_leaf(eg, SwarmError), ProtocolError)  # depth-first, in order
    assert first_leaf(eg, PeerTimeout) is None
    assert first_leaf(bad, SwarmError) is bad and first_leaf(bad, PeerLost) is None
