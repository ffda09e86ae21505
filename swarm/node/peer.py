"""The composition root: one function builds a running peer from its settings.

``shard-swarm join``, ``python -m swarm.node`` (the local swarms of the demo, tests and
benchmarks) and the in-memory tests all call :func:`open_peer` (or :func:`run_peer`, its
``nursery.start`` form) with one :class:`~swarm.node.settings.NodeSettings`. It measures the
model's time per layer, opens the host (a real libp2p host, or the one ``open_host`` gives, such
as ``swarm.testing.memnet``'s), starts membership, and (unless the peer holds no model) the
serving components (serving.py); the UI hears through :class:`~swarm.node.notices.Hooks`.
It also tells membership which adverts a full book must keep (:func:`_pinned`: the leader and
the plan's members, issue 27).

Theory of the tree: one nursery holds the host's tasks, membership (links, heartbeats, gossip,
dialing), the loop watch, the fast path, discovery and the leader loop; every epoch's tasks run
in it too, each bounded by its epoch (epochs.py). Leaving the ``async with`` cancels them all.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from swarm.errors import UsageError
from swarm.manifest.identity import Identity
from swarm.node.hosting import Host
from swarm.node.loopwatch import LoopWatch
from swarm.node.members.gossip import MemberEvent, MembershipService
from swarm.node.members.membership import Membership
from swarm.node.members.view import MemberView
from swarm.node.notices import Hooks, Notices
from swarm.node.settings import NodeSettings, advert_memory, advertised_resources, plan_memory

if TYPE_CHECKING:  # a peer without a model never imports torch: serving.py is imported where one is built
    from swarm.node.serving import Serving

SWITCH_INTERVAL_S = 0.001  # the GIL's hand-over interval in a node process (see open_peer)
HostOpener = Callable[[NodeSettings], contextlib.AbstractAsyncContextManager[Any]]


@dataclass
class Peer:
    """A running peer (see the module docstring); ``serving`` is None for a peer without a model."""

    settings: NodeSettings
    identity: Identity
    host: Host
    service: MembershipService
    view: MemberView
    notices: Notices
    loopwatch: LoopWatch
    serving: Serving | None = None

    def __repr__(self) -> str:
        return f"Peer({self.peer_id[:12]}…)"

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def epoch(self) -> Any:
        """The current epoch (epochs.Epoch), if any."""
        return self.serving.epochs.current if self.serving is not None else None

    def members(self) -> list[str]:
        return self.view.members()

    def leader(self) -> str:
        return self.view.leader()

    async def leave(self) -> None:
        """Leave on purpose, bounded (recovery.Recovery.leave)."""
        if self.serving is not None:
            await self.serving.recovery.leave()

    def start_corrupting(self) -> None:
        if self.serving is not None:
            self.serving.wiring.start_corrupting()

    def start_swallowing(self) -> None:
        if self.serving is not None:
            self.serving.wiring.start_swallowing()

    def status(self) -> dict[str, Any]:
        assert self.serving is not None
        return dict(self.serving.reporter.status())


def open_swarm_host(settings: NodeSettings) -> contextlib.AbstractAsyncContextManager[Any]:
    """The real libp2p host of these settings (swarm.net.host)."""
    from swarm.net.host import open_host

    s = settings
    return open_host(s.seed, s.listen, secret=s.secret, swarm_id=s.swarm_id, revoked=s.revoked)


@contextlib.asynccontextmanager
async def open_peer(
    settings: NodeSettings,
    *,
    hooks: Hooks | None = None,
    open_host: HostOpener = open_swarm_host,
    compute: Any = None,
    ms_per_layer: float | None = None,
    clock: Callable[[], float] = trio.current_time,
) -> AsyncIterator[Peer]:
    """A running peer (see the module docstring). ``compute``: where torch work runs
    (runtime.Compute; default a worker thread); ``ms_per_layer``: skip measuring (tests);
    ``clock``: the failure detector's clock (an in-memory test stops a frozen node's)."""
    s = settings
    hooks = hooks or Hooks()
    notices = Notices(hooks)
    identity = Identity(s.seed)
    models = None
    if s.model_dir is not None:
        import torch  # a peer without a model never loads torch

        from swarm.node.compute.memory import bounded_heap
        from swarm.node.compute.runtime import Compute, Models

        torch.set_num_threads(max(1, s.threads))
        bounded_heap()  # freed load temporaries leave the process (memory.py)
        # The trio thread takes the GIL back after every torch call or socket write it makes; while
        # a compute thread runs Python code (module calls between kernels) each such wait lasts up
        # to the switch interval: 5 ms by default, which a step of a few dozen calls turns into a
        # loop held for hundreds of ms (measured: 581 ms under 8 sessions). 1 ms bounds that.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        models = Models(s, compute or Compute(), notices)
        await models.measure(known=ms_per_layer)
        memory, device = advertised_resources(s)
        # less this peer's overhead, in the planner's unit (a mixed ring plans alike): planner/budget.py
        memory = advert_memory(memory, models.dtype, s.device, models.args, s.quant)
    else:
        memory, device = s.memory_bytes, None
    async with open_host(s) as host, contextlib.AsyncExitStack() as stack:
        # the fast path (its listener's nursery) is entered before the peer's nursery and left after it
        fastpath = await stack.enter_async_context(_open_fastpath(s, host)) if s.fastpath and models else None
        draft = models.drafts.advert(models.args, models.dtype, models.ms_per_layer, s.context_tokens) if models else None
        if draft is not None and models is not None:  # its bytes in the planner's unit, as the memory
            draft = (draft[0], plan_memory(draft[1], models.dtype), draft[2])
        membership = Membership(
            identity, s.swarm_id, addrs=_announce(s.announce, host), memory_bytes=memory,
            ms_per_layer=models.ms_per_layer if models is not None else 0.0, revoked=s.revoked, device=device,
            draft=draft, sessions=models.spec.sessions if models is not None else None,
            dtype_bytes=models.dtype.itemsize if models is not None else None,
        )  # fmt: skip
        # membership's news and a stop it noticed reach the serving components (built after it,
        # on it) through channels opened here, read by :func:`_hear` once the peer exists
        events, news = trio.open_memory_channel[MemberEvent](math.inf)
        stops, stopped = trio.open_memory_channel[float](math.inf)
        service = MembershipService(host, membership, clock=clock, on_event=events.send_nowait,
                                    on_stall=stops.send_nowait)  # fmt: skip
        view = MemberView(identity.peer_id, service, host)
        loopwatch = LoopWatch()
        async with trio.open_nursery() as nursery:
            serving = None
            if models is not None:
                from swarm.node.serving import Serving

                serving = Serving(s, identity, host, service, view, models, notices, loopwatch, nursery,
                                  fastpath=fastpath)  # fmt: skip
            peer = Peer(s, identity, host, service, view, notices, loopwatch, serving)
            membership.guard_book(pinned=functools.partial(_pinned, view, peer))
            nursery.start_soon(loopwatch.serve)
            nursery.start_soon(_hear, peer, news, stopped)
            await nursery.start(service.run)
            for addr in s.bootstrap:
                try:
                    service.add_candidate(addr, "bootstrap")  # never ourselves (membership.py)
                except UsageError as exc:
                    notices.notice(f"skipping bootstrap address: {exc}")
            if s.relay:
                from swarm.node.members.discovery import serve_relay_client

                nursery.start_soon(serve_relay_client, service, host, list(s.bootstrap), notices)
            if s.mdns:
                from swarm.node.members.discovery import serve_mdns

                nursery.start_soon(serve_mdns, service, host, s.swarm_id, notices)
            if peer.serving is not None:
                await peer.serving.run(nursery)
            notices.event(f"node {identity.peer_id} listening on {', '.join(host.addrs())}")
            try:
                yield peer
            finally:
                nursery.cancel_scope.cancel()


async def run_peer(
    settings: NodeSettings, *, task_status: Any = trio.TASK_STATUS_IGNORED, **kw: Any
) -> None:
    """:func:`open_peer` for ``await nursery.start(run_peer, settings)``: starts the peer, hands
    it to the caller, and runs until cancelled."""
    async with open_peer(settings, **kw) as peer:
        task_status.started(peer)
        await trio.sleep_forever()


async def _hear(peer: Peer, news: trio.MemoryReceiveChannel[MemberEvent], stopped: trio.MemoryReceiveChannel[float]) -> None:
    """Membership's news (:func:`_member_event`) and each stop of this node it noticed
    (recovery.Recovery.stalled), in order, for as long as the peer runs."""

    async def stops() -> None:
        async for gap in stopped:
            if peer.serving is not None:
                peer.serving.recovery.stalled(gap)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stops)
        async for ev in news:
            _member_event(peer, ev)


def _pinned(view: MemberView, peer: Peer) -> set[str]:
    """Members whose adverts a connected newcomer never evicts from a full advert book
    (membership.py): our leader, and the coordinator and stages of the plan we serve or last
    served (a plan's members must stay in every member's view, or a re-plan would drop them)."""
    out = {view.leader()}
    ep = peer.serving.epochs.current if peer.serving is not None else None
    if ep is not None:
        out |= {ep.plan.coordinator, *ep.plan.ring}
    return out


def _member_event(peer: Peer, ev: MemberEvent) -> None:
    if peer.serving is not None:
        peer.serving.recovery.member_event(ev)
    else:
        peer.view.kick()
    hooks = peer.notices.hooks
    if hooks.on_member is not None:
        hooks.on_member(ev)
    elif ev.kind != "updated":
        peer.notices.event(f"peer {ev.peer[:16]}… {ev.kind}" + (f" ({ev.reason})" if ev.reason else ""))


def _open_fastpath(s: NodeSettings, host: Any) -> contextlib.AbstractAsyncContextManager[Any]:
    from swarm.net.fastpath_host import open_fastpath_service

    return open_fastpath_service(
        host, listen_host=s.fastpath_host or _listen_ip(s.listen), port=s.fastpath_port,
        advertise=list(s.fastpath_advertise) or None,
    )  # fmt: skip


def _listen_ip(listen: tuple[str, ...]) -> str:
    """The IP of the first /ip4 listen address (the fast path's direct socket binds there)."""
    for a in listen:
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "127.0.0.1"


def _announce(announce: tuple[str, ...], host: Any) -> list[str]:
    if not announce:
        return list(host.addrs())
    return [a if "/p2p/" in a else f"{a}/p2p/{host.peer_id}" for a in announce]


__all__ = ["Hooks", "Peer", "open_peer", "run_peer"]
