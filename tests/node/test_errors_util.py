"""Our own errors out of trio's exception groups (node/errors_util.py): a lone leaf is unwrapped
however deep; a group of several stays a group; the first error of a kind is found anywhere."""

from __future__ import annotations

from swarm.errors import PeerLost, PeerTimeout, ProtocolError, SwarmError
from swarm.node.errors_util import first_leaf, unwrap


def test_a_lone_leaf_is_unwrapped_however_deep() -> None:
    lost = PeerLost("hop 2 closed")
    assert unwrap(ExceptionGroup("outer", [ExceptionGroup("inner", [lost])])) is lost
    assert unwrap(lost) is lost
    both = ExceptionGroup("two", [lost, PeerTimeout("slow")])
    assert unwrap(ExceptionGroup("outer", [both])) is both  # several errors: the group, not a guess


def test_the_first_error_of_a_kind_is_found_anywhere_in_a_group() -> None:
    bad = ProtocolError("forged plan")
    eg = ExceptionGroup("outer", [ValueError("a bug"), ExceptionGroup("inner", [KeyError("k"), bad, PeerLost("x")])])
    assert first_leaf(eg, ProtocolError) is bad
    assert isinstance(first_leaf(eg, SwarmError), ProtocolError)  # depth-first, in order
    assert first_leaf(eg, PeerTimeout) is None
    assert first_leaf(bad, SwarmError) is bad and first_leaf(bad, PeerLost) is None
