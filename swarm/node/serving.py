"""The serving half of a peer: the components that hold layers, plan, set up and run the ring,
serve generations and recover, wired together with explicit dependencies.

Construction order follows the dependencies, so nothing reaches through another object to find
what it needs, and each gets its collaborators when it is built: the model store and the epoch
state first; then the leader (planning, catch-up), recovery (losses, faults, leaving), the hops'
wiring and the generation service. The one cycle, the ring protocol's table (its handlers are
the leader's, recovery's and the wiring's, which send their own requests through it), is filled
once they exist and sealed before the protocol is served (dispatch.Handlers). The peer (peer.py)
owns the host and membership and starts :meth:`Serving.run`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import trio

from swarm.fetch.peers import Holds
from swarm.manifest.identity import Identity
from swarm.node.compute.fetching import BlockFetcher
from swarm.node.compute.members import TensorServer, serve_tensors
from swarm.node.compute.runtime import Models
from swarm.node.dispatch import CLIENT, MEMBER, Dispatcher, Handlers, RingClient
from swarm.node.generation.report import Reporter
from swarm.node.generation.resume import Resumer
from swarm.node.generation.service import GenService
from swarm.node.hosting import Host
from swarm.node.loopwatch import LoopWatch
from swarm.node.members.gossip import MembershipService
from swarm.node.members.probe import Prober
from swarm.node.members.view import MemberView
from swarm.node.notices import Notices
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.plan.leader import Leader
from swarm.node.plan.recovery import Recovery
from swarm.node.plan.wiring import Wiring, door_open
from swarm.node.ring.capacity import SlotQueue
from swarm.node.ring.fastlink import FrameLink
from swarm.node.settings import NodeSettings
from swarm.planner.budget import predicted_peak
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT, PROTO_GEN, PROTO_RING
from swarm.proto.messages import Plan as PlanMsg


class Serving:
    def __init__(
        self,
        settings: NodeSettings,
        identity: Identity,
        host: Host,
        service: MembershipService,
        view: MemberView,
        models: Models,
        notices: Notices,
        loopwatch: LoopWatch,
        nursery: trio.Nursery,
        *,
        fastpath: Any = None,
    ) -> None:
        peer_id = identity.peer_id
        self.models = models
        self.admission = SlotQueue()  # generations the ring's KV memory holds at once (capacity.py)

        def cannot_load(a: int, b: int, coordinator: bool) -> int:
            """Offer one layer less than the block that did not fit (and less than before): the
            leader's next plan gives us less, and nobody is blamed (node/compute/memory.py). One layer at a
            time, so a swarm that can hold the model without the layer we lack still finds it. A
            coordinator keeps room for its part (head, draft) beside the smaller block: lowered as a
            stage's, its offer left it one layer fewer than it could load, and a swarm in which every
            peer can load only its share then never served."""
            local = service.membership.local
            spec = models.spec.at_width(models.dtype.itemsize)  # as the leader states our layers (Peer.own)
            offer = local.memory_bytes
            fewer = predicted_peak(spec, (a, b - 1), coordinator=coordinator,  # the budget's arithmetic (planner/budget.py)
                                   draft_bytes=(local.draft_bytes or 0) if coordinator else 0)  # fmt: skip
            new = max(0, min(offer - spec.bytes_per_layer, fewer))
            if service.membership.update_local(memory_bytes=new):
                service.readvertise()
            return new

        # The control plane's one cycle: the leader and recovery answer ring requests and send
        # theirs through the ring client, whose own requests are answered by the same table. The
        # table is built empty, filled once they exist, and sealed before ring/1 is served
        # (dispatch.Handlers); an ended epoch reaches recovery through a channel opened here.
        ends, ended = trio.open_memory_channel[Epoch](math.inf)
        self.epochs = Epochs(settings, peer_id, models, self.admission, notices, leader=view.leader, memory=view.memory,
                             drafts=view.drafts, widths=view.widths, on_end=ends.send_nowait, cannot_load=cannot_load)  # fmt: skip
        ring_handlers = Handlers()
        self.ring = RingClient(host, peer_id, Dispatcher(view, self.epochs.roles, ring_handlers, PROTO_RING))
        self.leader = Leader(settings, identity, view, self.epochs, self.ring, models.spec, notices,
                             peers_file=service.membership.peers_file,
                             catch_stall=service.liveness.catch_stall,
                             door_open=functools.partial(door_open, host, fastpath))  # fmt: skip
        self.recovery = recovery = Recovery(view, self.epochs, self.leader, self.ring, notices, nursery, ended=ended)
        tensors = None  # members fetch from each other (issue 25): a liar is reported like a fault
        if models.fetch is not None:
            tensors = self._share_model_bytes(
                models.fetch, host, service, view, fastpath,
                report_liar=lambda peer, why: nursery.start_soon(recovery.report_bad_bytes, peer, why),
            )  # fmt: skip
        self.wiring = Wiring(
            peer_id, host, fastpath, self.epochs, models, notices, nursery,
            report_fault=recovery.report_fault, offered=lambda: service.membership.local.memory_bytes,
            own_draft=lambda: service.membership.local.draft_bytes or 0, tensors=tensors,
        )  # fmt: skip
        ring_handlers.add({
            PlanMsg: self.leader.on_plan,
            ctl.Current: self.leader.on_current,
            ctl.Ended: self.leader.on_ended,
            ctl.Connect: self.wiring.on_connect,
            ctl.Serve: self.wiring.on_serve,
            ctl.Leaving: recovery.on_leaving,
            ctl.Leave: recovery.on_leave,
            ctl.Fault: recovery.on_fault,
            ctl.BadBytes: recovery.on_bad_bytes,
        })  # fmt: skip
        ring_handlers.seal()
        self.reporter = Reporter(peer_id, host, service, view, self.epochs, self.wiring, models, self.admission, loopwatch)
        resumer = Resumer(peer_id, self.epochs, notices, self.leader.planning_problem, recovery.report_fault)
        gen_table = Dispatcher(view, self.epochs.roles, {}, PROTO_GEN)  # roles only: GenService answers
        self.gen = GenService(settings, peer_id, host, view, self.epochs, models, self.admission, self.reporter,
                              resumer, gen_table, planning_problem=self.leader.planning_problem)  # fmt: skip
        host.handle(PROTO_RING, self.ring.serve)
        host.handle(PROTO_ACT, self.wiring.serve_act)
        host.handle(PROTO_GEN, self.gen.serve, roles=(MEMBER, CLIENT))  # ring, act: members only (the door)
        self._fastpath = fastpath
        self._service = service

    @staticmethod
    def _share_model_bytes(fetcher: BlockFetcher, host: Host, service: MembershipService, view: MemberView,
                           fastpath: Any, *, report_liar: Callable[[str, str], None]) -> TensorServer:  # fmt: skip
        """Members fetch from each other (issue 25): serve what we hold verified on
        /shard-swarm/tensors/1, say in our advert which layers that is, and ask the members whose
        adverts say they hold what we need (not the benched or leaving) before the origin."""
        manifest = fetcher.cache.manifest

        def holders() -> dict[str, Holds]:
            ok = set(view.plannable())
            return {p: Holds.of_layers(manifest, a.held_layers(), head=bool(a.held_head))
                    for p, a in service.membership.view().items() if p in ok and (a.held or a.held_head)}  # fmt: skip

        def on_held(layers: list[int], head: bool) -> None:
            disk = fetcher.disk_left()  # what a plan may still ask it to fetch (issue 25)
            if service.membership.update_local(held=(layers, head), disk=-1 if disk is None else disk):
                service.readvertise()

        dial_fast = None
        if fastpath is not None:  # the same requests over the fast path where the member serves them

            async def dial_fast(peer: str, timeout: float) -> FrameLink:
                return FrameLink(await fastpath.dial(peer, timeout=timeout))

        fetcher.join_members(host, holders, on_held, dial_fast=dial_fast, report_liar=report_liar)
        served = serve_tensors(host, fetcher.holdings, widen=fetcher.widen if fetcher.local is not None else None)
        on_held(*fetcher.held())  # a restarted node says at once what its cache holds
        return served  # the fast channels that open with a range request (wiring.py)

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the serving tasks: the fast path's inbound channels, recovery's and the leader loop."""
        nursery.start_soon(self.recovery.run)
        if self._fastpath is not None:
            nursery.start_soon(self.wiring.accept_fast)
            nursery.start_soon(Prober(self._service, self._fastpath).run)  # RTTs on the hops' path
        nursery.start_soon(self.leader.run)
