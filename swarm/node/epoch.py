"""One plan epoch at a peer: accepting the plan, loading the block, wiring the hops, serving.

Theory of operation
-------------------
An epoch's set-up is driven by the leader in three phases (runtime.py); this module is what each
peer does in them. On PLAN it checks the leader's signature, ends the epoch it served, and loads
its block (kept across epochs when the block is unchanged) and, as coordinator, the head. On
``connect`` it opens every hop that leaves it, in traversal order: hop 0 is the coordinator's
send link, hop i + 1 is ring[i]'s downstream, the last hop enters the coordinator. A hop whose
two ends are this peer is an in-process LocalLink; any other is a fast-path channel (direct
sealed socket, or the libp2p stream when none can be opened) whose first frame is a ``hop``
hello naming the epoch and hop index, checked against the plan by the receiver. On ``serve`` the
coordinator waits for its result link and starts taking generations.

Every task of an epoch runs until the epoch ends (``Epoch.done``), and reports its own failure
with ``_end_epoch(..., only=ep)``: a stale report from an epoch already replaced changes nothing,
so tearing down old links can never end the epoch that replaced them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from swarm.errors import PeerError, ProtocolError, SwarmError
from swarm.model.stage import Head, Stage
from swarm.model.tokenizer import Tokenizer
from swarm.node.capacity import MAX_SESSIONS, ring_capacity, stage_capacity
from swarm.node.coordinator import Coordinator
from swarm.node.errors_util import unwrap
from swarm.node.fastlink import FrameLink
from swarm.node.links import Link, LocalLink
from swarm.node.stage_worker import StageWorker
from swarm.planner import Plan
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.messages import parse_message
from swarm.proto.signed import verify_plan

if TYPE_CHECKING:
    from swarm.model.config import ModelArgs
    from swarm.model.weights import Checkpoint
    from swarm.net.fastpath_host import FastpathService
    from swarm.net.host import SwarmHost

log = logging.getLogger("swarm.node")

LINK_TIMEOUT_S = 20.0
PUNCH_SETTLE_S = 8.0  # of the connect phase's LINK_TIMEOUT_S, spent at most on letting a hole punch finish
RPC_TIMEOUT_S = 20.0


@dataclass
class Epoch:
    """What this node does in one plan epoch."""

    plan: Plan
    signer: bytes
    stage: Stage | None = None
    worker: StageWorker | None = None
    coordinator: Coordinator | None = None
    inbound: dict[int, Link] = field(default_factory=dict)  # hop index -> link into this node
    inbound_ready: dict[int, trio.Event] = field(default_factory=dict)
    outbound: Link | None = None
    done: trio.Event = field(default_factory=trio.Event)
    serving: trio.Event = field(default_factory=trio.Event)
    started: float = field(default_factory=time.time)
    cause: str = ""  # the leader's words for why this epoch was planned (signed with the plan)
    msg: PlanMsg | None = None  # the signed plan as received (a peer catching up is shown it)
    phases: set[str] = field(default_factory=set)  # set-up steps taken ("connect", "serve"): once each
    hop_labels: dict[int, str] = field(default_factory=dict)  # hop -> "direct", "hole-punched", "relayed via …"

    def wait_inbound(self, hop: int) -> trio.Event:
        return self.inbound_ready.setdefault(hop, trio.Event())



MAX_CAUSE = 300


def plan_body(plan: Plan, cause: str = "") -> dict[str, Any]:
    """The signed part of a plan: integers and strings only (canonical JSON has no floats).
    ``cause``: why the leader planned this epoch ("first plan", "peer … is leaving", ...)."""
    return {
        "cause": cause[:MAX_CAUSE],
        "n_layers": plan.n_layers,
        "coordinator": plan.coordinator,
        "ring": list(plan.ring),
        "blocks": {p: [a, b] for p, (a, b) in plan.blocks.items()},
        "standbys": list(plan.standbys),
        "predicted_latency_us": int(round(plan.predicted_latency_ms * 1000)),
        "predicted_compute_us": int(round(plan.predicted_compute_ms * 1000)),
        "layers_moved": plan.layers_moved,
    }


def plan_from_body(epoch: int, body: dict[str, Any]) -> Plan:
    return Plan.from_json(
        {
            "epoch": epoch,
            "n_layers": body["n_layers"],
            "coordinator": body["coordinator"],
            "ring": body["ring"],
            "blocks": body["blocks"],
            "standbys": body.get("standbys", []),
            "predicted_latency_ms": body.get("predicted_latency_us", 0) / 1000,
            "predicted_compute_ms": body.get("predicted_compute_us", 0) / 1000,
            "layers_moved": body.get("layers_moved", 0),
        }
    )


async def _until_done(ep: Epoch, fn: Callable[[], Awaitable[None]]) -> None:
    """Run ``fn`` until it returns or the epoch ends; its own error comes out unwrapped."""
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await ep.done.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await fn()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None


def hops(plan: Plan) -> list[tuple[str, str]]:
    """The traversal's hops in order: coordinator -> ring[0] -> ... -> ring[-1] -> coordinator.
    Hop i enters ring[i]; the last hop enters the coordinator."""
    path = [plan.coordinator, *plan.ring, plan.coordinator]
    return [(path[i], path[i + 1]) for i in range(len(path) - 1)]


class EpochRole:
    """The per-epoch half of a Node (mixed into swarm.node.runtime.Node, which owns the state)."""

    # state owned by Node
    settings: Any
    args: ModelArgs
    ckpt: Checkpoint
    peer_id: str
    host: SwarmHost | None
    fastpath: FastpathService | None
    epoch: Epoch | None
    limiter: trio.CapacityLimiter
    spec: Any  # the planner's ModelSpec of this node's model, dtype and context
    service: Any  # the MembershipService (None before the host runs)
    admission: Any  # capacity.Admission: generations the ring holds at once
    tokenizer: Tokenizer | None
    hop_paths: dict[int, str]
    replans: Any  # a bounded deque of epoch ends
    corrupt: bool
    _nursery: trio.Nursery | None
    _stage_cache: dict[tuple[int, int], Stage]
    _head: Head | None
    _epoch_ended_at: float
    _cut_off_since: float | None
    _newest_plan: tuple[int, bytes | None]  # (epoch, signature) of the newest plan taken
    _end_reason: str
    _membership_changed: trio.Event
    _on_event: Callable[[str], None]

    async def report_fault(self, peer: str, reason: str, epoch: int) -> None:  # Node's
        raise NotImplementedError

    def life(self, event: str, **fields: Any) -> None:  # Node's
        raise NotImplementedError

    def leader(self) -> str:  # Node's
        raise NotImplementedError

    async def _accept_plan(self, sender: str, msg: PlanMsg, *, catching_up: bool = False) -> None:
        """Take the leader's plan (``catching_up``: a plan the swarm already serves, which this
        node, back from being cut off, was shown by a member; its signer need not lead here)."""
        if msg.signer is None:
            raise ProtocolError(f"plan epoch {msg.epoch} from {sender} is unsigned")
        verify_plan(msg, msg.signer, self.settings.swarm_id)
        from swarm.proto.signing import peer_id_of

        signer_id = peer_id_of(msg.signer)
        if signer_id != self.leader() and not catching_up:
            raise ProtocolError(f"plan epoch {msg.epoch} signed by {signer_id}, but the leader here is {self.leader()}")
        try:
            plan = plan_from_body(msg.epoch, msg.plan)
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"plan epoch {msg.epoch} from {sender}: missing field {exc}") from None
        if self.epoch is not None and plan.epoch <= self.epoch.plan.epoch and not self.epoch.done.is_set():
            raise ProtocolError(f"plan epoch {plan.epoch} is not newer than the serving epoch {self.epoch.plan.epoch}")
        newest, signature = self._newest_plan
        if plan.epoch < newest or (plan.epoch == newest and msg.signature != signature):
            # an old plan stays old when the newer epoch ends: it is never taken again
            raise ProtocolError(f"plan epoch {plan.epoch} from {sender}: epoch {newest} was planned already")
        self._newest_plan = (plan.epoch, msg.signature)
        ended_at = self._epoch_ended_at if self.epoch is not None and self.epoch.done.is_set() else None
        if self.epoch is not None:
            self._end_epoch(f"replaced by epoch {plan.epoch}")
        cause = msg.plan.get("cause", "")
        ep = Epoch(plan, msg.signer, cause=cause[:MAX_CAUSE] if isinstance(cause, str) else "", msg=msg)
        self.epoch = ep
        if self._cut_off_since == float("-inf"):
            self._cut_off_since = None  # a new node that took a plan knows the swarm's epoch now
        s = self.settings
        role = "+".join(r for r, on in (("coordinator", plan.coordinator == self.peer_id),
                                         ("stage", self.peer_id in plan.blocks)) if on) or "standby"  # fmt: skip
        pause = None if ended_at is None else trio.current_time() - ended_at
        self.life("plan", epoch=plan.epoch, role=role, block=list(plan.blocks.get(self.peer_id, ())) or None,
                  coordinator=plan.coordinator, ring=list(plan.ring), cause=ep.cause,
                  pause_s=None if pause is None else round(pause, 3))  # fmt: skip
        if self.peer_id in plan.blocks:
            a, b = plan.blocks[self.peer_id]
            ep.stage = await self._load_stage(a, b)
        if plan.coordinator == self.peer_id:
            head = await self._load_head()
            first = plan.ring[0]
            ep.coordinator = Coordinator(
                head, epoch=plan.epoch, first_hop=first, chunk_timeout=s.chunk_timeout, limiter=self.limiter,
                compute_delay_s=s.compute_delay_s,
            )  # fmt: skip
            if self.service is not None:  # how many generations the ring's KV memory holds (capacity.py)
                memory = {p: a.memory_bytes for p, a in self.service.membership.view().items()}
                self.admission.set_capacity(max(self.settings.sessions, ring_capacity(self.spec, plan, memory)))
            if self.tokenizer is None:
                with contextlib.suppress(SwarmError):  # parsing tokenizer.json takes a while: off the loop
                    self.tokenizer = await trio.to_thread.run_sync(Tokenizer.from_dir, s.model_dir)

    async def _load_stage(self, a: int, b: int) -> Stage:
        cached = self._stage_cache.get((a, b))
        if cached is not None:
            return cached
        self._stage_cache.clear()  # free the old block before loading the new one
        self._on_event(f"loading layers [{a}, {b})")
        self.life("loading", layers=[a, b], done=False)
        s = self.settings
        t0 = trio.current_time()
        stage = await trio.to_thread.run_sync(
            lambda: Stage.load(self.args, self.ckpt.source, a, b, dtype=s.dtype, device=s.device, quant=s.quant),
            limiter=self.limiter,
        )
        self.life("loading", layers=[a, b], done=True, seconds=round(trio.current_time() - t0, 3))
        self._stage_cache[(a, b)] = stage
        return stage

    async def _load_head(self) -> Head:
        if self._head is None:
            s = self.settings
            self._head = await trio.to_thread.run_sync(
                lambda: Head.load(self.args, self.ckpt.source, dtype=s.dtype, device=s.device), limiter=self.limiter
            )
        return self._head

    async def _connect(self, epoch: int) -> None:
        """Open every hop that leaves this node; start our stage worker. Once per epoch: a
        repeated ``connect`` is a no-op (never a second worker nor a replaced link)."""
        ep = self._current(epoch)
        if "connect" in ep.phases:
            return
        ep.phases.add("connect")
        assert self._nursery is not None
        nursery = self._nursery
        if self.host is not None:  # a hop opened on a relayed connection dies when DCUtR replaces it
            with trio.move_on_after(PUNCH_SETTLE_S):
                async with trio.open_nursery() as settling:
                    for src, dst in hops(ep.plan):
                        if src == self.peer_id and dst != self.peer_id:
                            settling.start_soon(functools.partial(self.host.settle_path, dst, timeout=PUNCH_SETTLE_S))
        for i, (src, dst) in enumerate(hops(ep.plan)):
            if src != self.peer_id:
                continue
            if dst == self.peer_id:
                link = LocalLink(f"{self.peer_id[:8]} hop {i}")
                self.hop_paths[i] = "local"
                self._set_inbound(ep, i, link)
                self._set_outbound(ep, i, link)
            else:
                ready = trio.Event()
                self._nursery.start_soon(self._hold_outbound, ep, i, dst, ready)
                with trio.fail_after(LINK_TIMEOUT_S):
                    await ready.wait()
        if ep.stage is not None:
            idx = ep.plan.ring.index(self.peer_id)
            upstream = ep.plan.ring[idx - 1] if idx > 0 else ep.plan.coordinator
            ep.worker = StageWorker(
                ep.stage, epoch=epoch, upstream=upstream, is_tail=idx == len(ep.plan.ring) - 1,
                max_len=min(self.settings.context_tokens, self.args.max_seq_len), limiter=self.limiter,
                on_bad_input=lambda peer, why: nursery.start_soon(self.report_fault, peer, why, epoch),
                compute_delay_s=self.settings.compute_delay_s, max_sessions=self._stage_capacity(ep),
            )  # fmt: skip
            if self.corrupt:
                ep.worker.corrupt_after = 0
            self._nursery.start_soon(self._run_worker, ep, idx)
            if ep.coordinator is None:
                self.life("serving", epoch=epoch, role="stage")

    def _stage_capacity(self, ep: Epoch) -> int:
        """Sessions our block's KV caches fit in the memory we offered (capacity.py)."""
        if self.service is None:
            return MAX_SESSIONS
        offered = self.service.membership.local.memory_bytes
        block = ep.plan.blocks[self.peer_id]
        fits = stage_capacity(self.spec, offered, block, coordinator=ep.plan.coordinator == self.peer_id)
        return min(MAX_SESSIONS, max(self.settings.sessions, fits))

    def _set_outbound(self, ep: Epoch, hop: int, link: Link) -> None:
        """Hop 0 is the coordinator's send link; hop i + 1 is ring[i]'s downstream."""
        if hop == 0 and ep.coordinator is not None:
            ep.coordinator.attach(link)
        if ep.stage is not None and hop == ep.plan.ring.index(self.peer_id) + 1:
            ep.outbound = link

    def _set_inbound(self, ep: Epoch, hop: int, link: Link) -> None:
        ep.inbound[hop] = link
        ep.wait_inbound(hop).set()

    async def _hold_outbound(self, ep: Epoch, hop: int, dst: str, ready: trio.Event) -> None:
        assert self.host is not None
        hello = ctl.Hop(ep.plan.epoch, hop).to_frame()
        try:
            if self.fastpath is not None:
                link = FrameLink(await self.fastpath.dial(dst, timeout=LINK_TIMEOUT_S))
                try:
                    await link.send(hello, timeout=LINK_TIMEOUT_S)
                    self.hop_paths[hop] = link.path
                    self._set_outbound(ep, hop, link)
                    ready.set()
                    await ep.done.wait()
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await link.close()
            else:
                async with self.host.open_stream(dst, PROTO_ACT, timeout=LINK_TIMEOUT_S) as fs:
                    await fs.send(hello)
                    self.hop_paths[hop] = "libp2p"
                    self._set_outbound(ep, hop, fs)
                    ready.set()
                    await ep.done.wait()
        except SwarmError as exc:
            log.warning("activation link to %s (epoch %d) ended: %s", dst, ep.plan.epoch, exc)
            self._end_epoch(f"link to {dst} failed: {exc}", only=ep)

    async def _accept_fast(self) -> None:
        assert self.fastpath is not None and self._nursery is not None
        async for channel in self.fastpath.incoming:
            self._nursery.start_soon(self._serve_fast_act, FrameLink(channel))

    async def _serve_fast_act(self, link: FrameLink) -> None:
        try:
            await self._serve_act(link.peer, link)
        except SwarmError as exc:
            log.warning("activation channel from %s: %s", link.peer, exc)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await link.close()

    async def _serve_act(self, peer: str, fs: Link) -> None:
        hello = parse_message(await fs.receive(timeout=RPC_TIMEOUT_S))
        if not isinstance(hello, ctl.Hop):
            raise ProtocolError(f"peer {peer}: activation stream must start with a hop hello")
        epoch, hop = hello.epoch, hello.hop
        ep = self._current(epoch)
        path = hops(ep.plan)
        if hop >= len(path) or path[hop] != (peer, self.peer_id):
            raise ProtocolError(f"peer {peer} does not send hop {hop} to {self.peer_id} in epoch {epoch}")
        self._set_inbound(ep, hop, fs)
        await ep.done.wait()

    async def _run_worker(self, ep: Epoch, idx: int) -> None:
        worker = ep.worker
        assert worker is not None

        async def run() -> None:
            with trio.fail_after(LINK_TIMEOUT_S):
                await ep.wait_inbound(idx).wait()
                while ep.outbound is None:
                    await trio.sleep(0.01)
            await worker.serve(ep.inbound[idx], ep.outbound)

        try:
            await _until_done(ep, run)
        except (SwarmError, trio.TooSlowError) as exc:
            self._end_epoch(f"stage worker: {exc}", only=ep)

    def hop_labels(self, epoch: int) -> dict[int, str]:
        """How each hop leaving this node travels, for receipts and status: "local" (in this
        process), "direct" (a direct socket or connection), "hole-punched" (a direct connection
        DCUtR made from a relayed one) or "relayed via <relay>"."""
        ep = self._current(epoch)
        out: dict[int, str] = {}
        for i, (src, dst) in enumerate(hops(ep.plan)):
            if src != self.peer_id:
                continue
            kind = self.hop_paths.get(i, "")
            if kind in ("local", "direct"):
                out[i] = kind  # "direct": the fast path's own sealed TCP socket
            elif self.host is not None:
                out[i] = self.host.path_label(dst)
        return out

    async def _start_serving(self, epoch: int, hop_labels: dict[int, str] | None = None) -> None:
        ep = self._current(epoch)
        ep.hop_labels = dict(hop_labels or {})
        if ep.coordinator is None:
            raise ProtocolError(f"{self.peer_id} is not the coordinator of epoch {epoch}")
        if "serve" in ep.phases:
            return
        ep.phases.add("serve")
        with trio.fail_after(LINK_TIMEOUT_S):
            await ep.wait_inbound(len(ep.plan.ring)).wait()
        assert self._nursery is not None
        tail = ep.plan.ring[-1]
        self._nursery.start_soon(self._run_results, ep, tail)
        ep.serving.set()
        self._on_event(f"serving epoch {epoch}: ring ready")
        self.life("serving", epoch=epoch, role="coordinator")

    async def _run_results(self, ep: Epoch, tail: str) -> None:
        coord = ep.coordinator
        assert coord is not None
        try:
            await _until_done(ep, lambda: coord.serve_results(ep.inbound[len(ep.plan.ring)], tail_peer=tail))
        except SwarmError as exc:
            self._end_epoch(f"result link: {exc}", only=ep)

    def _current(self, epoch: int) -> Epoch:
        ep = self.epoch
        if ep is None or ep.plan.epoch != epoch or ep.done.is_set():
            have = None if ep is None else ep.plan.epoch
            raise ProtocolError(f"epoch {epoch} is not current here (current: {have})")
        return ep

    def _end_epoch(self, reason: str, *, only: Epoch | None = None) -> None:
        """End the current epoch. ``only``: a task of that epoch is reporting its own failure;
        if a newer epoch has replaced it meanwhile, the report is stale and changes nothing
        (an old link torn down must never end the epoch that replaced it)."""
        ep = self.epoch
        if only is not None and ep is not only:
            return
        if ep is None or ep.done.is_set():
            return
        log.info("epoch %d ends: %s", ep.plan.epoch, reason)
        self._end_reason = reason
        self.replans.append({"epoch": ep.plan.epoch, "ended": time.time(), "reason": reason})
        if ep.coordinator is not None:
            ep.coordinator._fail_all(PeerError(f"epoch {ep.plan.epoch} ended: {reason}"))
        self._epoch_ended_at = trio.current_time()
        ep.done.set()
        self.life("replan", ended_epoch=ep.plan.epoch, cause=reason[:300])
        self._kick_leader()
        with contextlib.suppress(AssertionError, IndexError):  # a node not running yet has no leader
            if self._nursery is not None and self.leader() != self.peer_id:
                self._nursery.start_soon(self._nudge_leader, ep)  # if no new plan comes, say so

    async def _nudge_leader(self, ended: Epoch) -> None:  # Node's
        raise NotImplementedError

    def _kick_leader(self) -> None:
        """Wake the leader loop once. The event is replaced after being set: one left set would
        make every later wait return at once, and the loop spin."""
        self._membership_changed.set()
        self._membership_changed = trio.Event()

    # -- generation service ---------------------------------------------------------------
