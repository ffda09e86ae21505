"""hosting.Host: the real libp2p host and the in-memory one offer node/ the same methods.

mypy checks that SwarmHost is a Host (hosting.py); this test holds the in-memory MemHost, which the
fast in-memory swarms run on, to the same interface, so a method node/ starts to use on one host
cannot be missing, or take other keywords, on the other."""

from __future__ import annotations

import inspect

import pytest

from swarm.net.host import SwarmHost
from swarm.node.hosting import Host
from swarm.testing.memnet import MemHost

METHODS = sorted(n for n, v in vars(Host).items() if inspect.isfunction(v) and not n.startswith("_"))


def _params(fn: object) -> list[tuple[str, object]]:
    """Parameter names and kinds after ``self`` (defaults may differ: each host picks its own)."""
    return [(p.name, p.kind) for p in list(inspect.signature(fn).parameters.values())[1:]]  # type: ignore[arg-type]


def test_the_interface_names_what_node_uses() -> None:
    assert {"handle", "open_stream", "dial", "subscribe", "path_label", "settle_path"} <= set(METHODS)


@pytest.mark.parametrize("cls", [SwarmHost, MemHost], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_each_host_has_the_method_with_the_interfaces_parameters(cls: type, name: str) -> None:
    impl = getattr(cls, name, None)
    assert callable(impl), f"{cls.__name__} lacks {name}"
    want = _params(getattr(Host, name))
    got = _params(impl)
    assert got[: len(want)] == want, f"{cls.__name__}.{name}{inspect.signature(impl)} vs Host.{name}"
    extra = got[len(want) :]  # more parameters only where the interface's callers need not give them
    assert all(inspect.signature(impl).parameters[n].default is not inspect.Parameter.empty for n, _ in extra), name
    assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(getattr(Host, name)), name
