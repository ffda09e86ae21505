"""A running peer: host, membership, the plan for each epoch, its stage, and the coordinator role.

Theory of operation
-------------------
Agreement. Every admitted member publishes signed adverts (membership.py). One member, the
*leader*, turns them into a plan: the live member with the smallest peer ID (every peer can tell
who that is from its own view, and a peer that sees a smaller live ID than the signer of a plan
it receives refuses the plan). The leader signs {epoch, plan} with its identity key and drives
the epoch's set-up over ``/shard-swarm/ring/1``, one phase at a time, each bounded by a timeout:

1. PLAN -> every peer in the plan loads its block (and the coordinator its head and drafter),
   replies ``loaded``;
2. ``connect`` -> each sends a ``hop`` hello on a new ``/shard-swarm/act/1`` stream to its next hop
   (the coordinator to ring[0]; stage i to stage i+1; the tail to the coordinator), replies
   ``linked`` once its outbound stream is open;
3. ``serve`` -> the coordinator waits for its result link and starts taking generations.

A peer that was cut off (stopped, asleep: its heartbeat clock jumped; or it saw every other
member go) may be the smallest ID again when it comes back, but its view is stale: the others
re-planned without it, and its view churns while they drop and re-admit it. Before it plans,
such a peer (and a fresh one) lets its view settle (CUT_OFF_SETTLE_S, at most CATCH_UP_WAIT_S)
and asks the members what they serve (``current``), even while it still holds an epoch of its
own: if they serve a newer one whose ring is all in its view, it takes that epoch as a standby
and leads from there, so coming back never moves the coordinator or disturbs a run; otherwise it
plans sticky with the swarm's epoch, not its own. As a fallback, a member whose ring ended and
that sees no new plan within NUDGE_AFTER_S tells the leader which epoch ended (``ended``): a
leader that finds it is behind catches up the same way, so the swarm never waits on it forever.

We chose leader-signs-and-distributes over "everyone computes the plan from one snapshot": RTTs
are measured by each peer and change all the time, so identical snapshots would need a consensus
round anyway; with a leader, a plan is computed once and every peer can check who signed it.

When. The leader plans once the expected number of members is present (``expect_peers``, used by
the demo) or, without it, once membership has been stable for ``settle_s`` and the members can
hold the model. A peer that joins later becomes a standby: the ring is never re-planned while it
serves. A lost ring member ends the epoch and the leader plans the next one from the survivors
(sticky: they keep their blocks where they can); the coordinator's generations pause and resume on
the new ring by replaying what they had fed it (service.py), so no token is lost or changed. A
plan that cannot be made yet (too little memory, an edge nobody has measured) is retried on the
next membership news.

Data path: see stage_worker.py and coordinator.py. Hops whose two ends are this process use an
in-process LocalLink; the others are libp2p streams (Noise-encrypted, admission-gated).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import trio

from swarm.errors import PeerError, PeerTimeout, PlanningError, ProtocolError, SwarmError
from swarm.manifest.identity import Identity
from swarm.model.config import ModelArgs
from swarm.model.devices import auto_memory_bytes, describe_device, synchronize
from swarm.model.quant import layer_bytes as quant_layer_bytes
from swarm.model.quant import quantize_block
from swarm.model.stage import Head, Stage
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import Checkpoint, open_checkpoint
from swarm.net.fastpath_host import FastpathService, open_fastpath_service
from swarm.net.host import SwarmHost, open_host
from swarm.net.streams import FramedStream
from swarm.node.authority import (
    FaultClaims,
    check_epoch_step,
    check_fault_report,
)
from swarm.node.capacity import Admission
from swarm.node.control import Dispatcher, role_of
from swarm.node.epoch import (
    LINK_TIMEOUT_S,
    RPC_TIMEOUT_S,
    Epoch,
    EpochRole,
    hops,
    plan_body,
    plan_from_body,
)
from swarm.node.errors_util import first_leaf
from swarm.node.loopwatch import LoopWatch
from swarm.node.membership import MemberEvent, Membership, MembershipService
from swarm.planner import ModelSpec, Peer, Plan, parse_peers_file
from swarm.planner import plan as make_plan
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT, PROTO_GEN, PROTO_RING
from swarm.proto.messages import Message, parse_message
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import sign_plan, verify_plan
from swarm.proto.signing import peer_id_of

log = logging.getLogger("swarm.node")
R = TypeVar("R", bound=ctl.Control)

LOAD_TIMEOUT_S = 600.0
SWITCH_INTERVAL_S = 0.001  # the GIL's hand-over interval in a node process (see Node.run)
REPLAN_SETTLE_S = 0.15
LEAVE_TIMEOUT_S = 5.0  # a leaver waits at most this long for its hand-over, then goes anyway
LEAVING_NOTICE_S = 1.5  # ... of which telling the members it leaves takes at most this long
CATCH_UP_TIMEOUT_S = 2.0  # a peer back from being cut off asks the others what they serve
CATCH_UP_WAIT_S = 3.0  # ... and waits at most this long for its view to settle / that ring to reappear
NUDGE_AFTER_S = 4.0  # a member whose ring ended tells the leader after this long without a new plan
CUT_OFF_SETTLE_S = 1.0  # ... the view it catches up from has been unchanged this long
EXCLUDE_S = 300.0  # a peer caught sending bad activations stays out of plans this long  # after a loss: re-plan as soon as membership stops changing


@dataclass
class NodeSettings:
    seed: bytes
    swarm_id: str
    secret: bytes
    model_dir: Path
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()  # addresses to advertise instead of the listen ones (e.g. behind a proxy)
    bootstrap: tuple[str, ...] = ()
    memory_bytes: int = 0  # offered for layers; 0 = what the device has free (model/devices.py)
    dtype: torch.dtype = torch.bfloat16
    quant: str = "none"  # the invite's: how the decoder layers are held (swarm.model.quant)
    device: str = "cpu"  # cpu, cuda:N or mps, already resolved (swarm.model.devices.resolve_device)
    threads: int = 1
    coordinator_ok: bool = True
    expect_peers: int = 0  # plan once this many members (us included) are present
    settle_s: float = 3.0
    context_tokens: int = 2048
    draft: str = "ngram"
    chunk_timeout: float = 30.0
    revoked: frozenset[str] = frozenset()
    fastpath: bool = True  # activations over a direct sealed socket when one can be opened
    fastpath_port: int = 0
    fastpath_host: str = ""  # IP the direct socket binds (default: the first /ip4 listen address)
    fastpath_advertise: tuple[str, ...] = ()  # "ip:port" to announce (e.g. behind a proxy or NAT)
    sessions: int = 8  # generations held at once at least (their KV on top of memory_bytes): capacity.py
    compute_delay_s: float = 0.0  # fault injection (load tests): every forward and head call blocks this much longer


def model_spec(args: ModelArgs, dtype: torch.dtype, context_tokens: int, quant: str = "none") -> ModelSpec:
    nbytes = torch.empty(0, dtype=dtype).element_size()
    return ModelSpec(
        n_layers=args.n_layers,
        layer_bytes=quant_layer_bytes(args, quant, nbytes),
        kv_bytes_per_token_per_layer=args.kv_bytes_per_token_per_layer(nbytes),
        coordinator_bytes=args.head_bytes(nbytes),
        context_tokens=context_tokens,
    )


def measure_ms_per_layer(
    args: ModelArgs, dtype: torch.dtype, device: str, *, repeats: int = 15, quant: str = "none"
) -> float:
    """Median time of one decoder layer on one token, with random weights of the model's shapes
    (on an accelerator each pass is waited for, so the figure is the work, not its launch)."""
    dev = torch.device(device)
    stage = Stage(args, 0, 1, dtype=dtype, device=device)
    stage = stage.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.0, 0.02)
    stage.requires_grad_(False)
    quantize_block(stage, quant, dtype=dtype)
    stage.open_session("probe", repeats + 2)
    h = torch.randn(1, args.dim, dtype=dtype, device=device)
    times = []
    stage.forward("probe", h)  # warm-up: kernels chosen, caches allocated (not timed)
    synchronize(dev)
    for _ in range(repeats):
        t0 = time.perf_counter()
        stage.forward("probe", h)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    stage.close_session("probe")
    times.sort()
    return 1000.0 * times[len(times) // 2]


def advertised_resources(s: NodeSettings) -> tuple[int, tuple[str, str]]:
    """(memory offered for layers, (device kind, name)) for this node's advert: ``memory_bytes``
    when the user gave one, else what the device has free (on a GPU, its memory less a margin)."""
    device = torch.device(s.device)
    return s.memory_bytes or auto_memory_bytes(device), describe_device(device)


class Node(EpochRole):
    """One peer of a swarm. ``await nursery.start(node.run)``; see the module docstring."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        on_event: Callable[[str], None] | None = None,
        on_member: Callable[[MemberEvent], None] | None = None,
        on_life: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.identity = Identity(settings.seed)
        self.peer_id = self.identity.peer_id
        self.ckpt: Checkpoint = open_checkpoint(settings.model_dir)
        self.args = self.ckpt.args
        self.spec = model_spec(self.args, settings.dtype, settings.context_tokens, settings.quant)
        self.tokenizer: Tokenizer | None = None
        self.limiter = trio.CapacityLimiter(1)
        self._on_event = on_event or (lambda text: None)
        self._on_life = on_life  # the node's life as events (join --json): plan, loading, serving, replan, leaving
        self._notice_level = logging.DEBUG if on_event is not None else logging.INFO  # shown once, not twice
        self._planning_said = ""  # the last "cannot plan yet" reason shown
        self._on_member = on_member
        self.host: SwarmHost | None = None
        self.service: MembershipService | None = None
        self.epoch: Epoch | None = None
        self._last_epoch = 0  # the highest epoch this node has proposed (never reused)
        self._leaving: set[str] = set()
        self._epoch_ended_at = -1e9  # trio time the last epoch ended
        self._end_reason = ""  # ... and why (the next plan carries it as its cause)
        # trio time our view of the epochs went stale (None: it is not); a new node's is unknown
        # (-inf: it asks the members what they serve before its first plan, without waiting)
        self._cut_off_since: float | None = float("-inf")
        self._plan_msg: PlanMsg | None = None  # the leader's signed plan of the serving epoch
        self._informed: set[str] = set()  # members that were sent it
        self._excluded: dict[str, float] = {}  # peer -> trio time until which plans skip it
        self._claims = FaultClaims(window=EXCLUDE_S)  # fault reports heard (authority.py)
        self.recent: collections.deque[tuple[float, float | None]] = collections.deque(maxlen=20)
        self.corrupt = False  # fault injection (chaos tests, SIGUSR1 in python -m swarm.node)
        self.replans: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)  # epoch ends, for status
        self._membership_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._stage_cache: dict[tuple[int, int], Stage] = {}
        self._newest_plan: tuple[int, bytes | None] = (0, None)
        self._head: Head | None = None
        self.ms_per_layer = 0.0
        self.fastpath: FastpathService | None = None
        self.hop_paths: dict[int, str] = {}  # hop index -> "direct" | "libp2p" | "local", for status
        self.loopwatch = LoopWatch()  # how long the trio loop is held (status "loop")
        self.admission = Admission()  # generations the ring's KV memory holds at once (capacity.py)
        self.ring = Dispatcher(self, {
            PlanMsg: self._on_plan, ctl.Connect: self._on_connect, ctl.Serve: self._on_serve,
            ctl.Current: self._on_current, ctl.Ended: self._on_ended, ctl.Leaving: self._on_leaving,
            ctl.Leave: self._on_leave, ctl.Fault: self._on_fault,
        }, PROTO_RING)  # fmt: skip
        self.gen_roles = Dispatcher(self, {}, PROTO_GEN)  # generation requests' roles (service.py)

    def __repr__(self) -> str:
        return f"Node({self.peer_id[:12]}…)"

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        torch.set_num_threads(max(1, s.threads))
        # The trio thread takes the GIL back after every torch call or socket write it makes; while a
        # compute thread runs Python code (module calls between kernels) each such wait lasts up to
        # the switch interval: 5 ms by default, which a step of a few dozen calls turns into a
        # loop held for hundreds of ms (measured: 581 ms under 8 sessions). 1 ms bounds that.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.ms_per_layer = await trio.to_thread.run_sync(
            functools.partial(measure_ms_per_layer, self.args, s.dtype, s.device, quant=s.quant), limiter=self.limiter
        )
        memory, device = advertised_resources(s)
        async with open_host(s.seed, s.listen, secret=s.secret, swarm_id=s.swarm_id, revoked=s.revoked) as host:
            self.host = host
            membership = Membership(
                self.identity, s.swarm_id, addrs=_announce(s.announce, host), memory_bytes=memory, ms_per_layer=self.ms_per_layer,
                revoked=s.revoked, device=device,
            )  # fmt: skip
            self.service = MembershipService(host, membership, on_event=self._member_event, on_stall=self._stalled)
            host.handle(PROTO_RING, self._serve_ring)
            host.handle(PROTO_ACT, self._serve_act)
            host.handle(PROTO_GEN, self._serve_gen)
            async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.loopwatch.serve)
                if s.fastpath:
                    self.fastpath = await stack.enter_async_context(
                        open_fastpath_service(
                            host, listen_host=s.fastpath_host or _listen_ip(s.listen), port=s.fastpath_port,
                            advertise=list(s.fastpath_advertise) or None,
                        )
                    )  # fmt: skip
                    nursery.start_soon(self._accept_fast)
                await nursery.start(self.service.run)
                for addr in s.bootstrap:
                    if self.peer_id not in addr:
                        self.service.add_candidate(addr, "bootstrap")
                nursery.start_soon(self._leader_loop)
                self._on_event(f"node {self.peer_id} listening on {', '.join(host.addrs())}")
                task_status.started(self)
                await trio.sleep_forever()

    def life(self, event: str, **fields: Any) -> None:
        """One event of this node's life for a machine reader (``join --json``)."""
        if self._on_life is not None:
            self._on_life({"event": event, **fields})

    def notice(self, text: str) -> None:
        """A one-line notice for the user (and the log)."""
        log.log(self._notice_level, "%s", text)
        self._on_event(text)

    def _member_event(self, ev: MemberEvent) -> None:
        self._kick_leader()
        if self._on_member is not None:
            self._on_member(ev)
        elif ev.kind != "updated":
            self._on_event(f"peer {ev.peer[:16]}… {ev.kind}" + (f" ({ev.reason})" if ev.reason else ""))
        if ev.kind in ("left", "lost"):
            self._leaving.discard(ev.peer)  # gone: if it comes back (same key, restarted), it is a member again
        if ev.kind in ("left", "lost") and self.members() == [self.peer_id] and self._cut_off_since is None:
            self._cut_off_since = trio.current_time()  # everyone else went: they may go on without us
        if ev.kind in ("left", "lost") and self.epoch is not None:
            ring = {*self.epoch.plan.ring, self.epoch.plan.coordinator}
            if ev.peer in ring:
                self._end_epoch(f"ring member {ev.peer} {ev.kind}" + (f" ({ev.reason})" if ev.reason else ""))  # nudges the leader

    async def _nudge_leader(self, ended: Epoch) -> None:
        """A ring we served ended; if no new plan comes within NUDGE_AFTER_S, tell the leader
        which epoch ended: one whose own view is stale (it was cut off and missed that epoch)
        then knows to catch up, instead of the swarm waiting on it forever."""
        await trio.sleep(NUDGE_AFTER_S)
        if self.epoch is not ended or self.leader() == self.peer_id:
            return
        try:
            with trio.fail_after(RPC_TIMEOUT_S):
                await self._ring_call(self.leader(), ctl.Ended(ended.plan.epoch))
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("could not tell the leader that epoch %d ended: %s", ended.plan.epoch, exc)

    def _stalled(self, gap: float) -> None:
        self.notice(f"this node was stopped for {gap:.1f} s: it catches up with the swarm before it plans")
        self._cut_off_since = trio.current_time()
        self._kick_leader()

    def admitted_role(self, peer: str) -> str | None:
        """"member", "client" or None (not admitted), as the host tells it (control.role_of)."""
        assert self.host is not None and self.service is not None
        return role_of(self.host, peer, advertised=self.service.membership.get(peer) is not None)

    def epoch_roles(self, epoch: int) -> tuple[str, set[str]]:
        """(the plan's signer, the coordinator and ring) of ``epoch``, the current one here."""
        ep = self._current(epoch)
        return peer_id_of(ep.signer), {ep.plan.coordinator, *ep.plan.ring}

    def members(self) -> list[str]:
        """Live members that have advertised (clients that only ask for generations never do)."""
        assert self.service is not None
        view = self.service.membership.view()
        return sorted({self.peer_id, *(p for p in self.service.members() if p in view)})

    def plannable(self) -> list[str]:
        """Members a plan may use: not the ones leaving, nor those recently caught misbehaving."""
        now = trio.current_time()
        return [p for p in self.members() if p not in self._leaving and self._excluded.get(p, 0.0) <= now]

    def leader(self) -> str:
        """The smallest live member ID that is not leaving (a leaving leader hands over to the
        next one; if every member is leaving, the smallest of them)."""
        members = self.members()
        return next((p for p in members if p not in self._leaving), members[0])

    # -- leader: plan and drive set-up ------------------------------------------------------

    async def _leader_loop(self) -> None:
        s = self.settings
        last_members: list[str] = []
        stable_since = trio.current_time()
        wait = 0.5  # until the next look, unless woken: exact when a settle time is running out
        while True:
            with trio.move_on_after(wait):
                await self._membership_changed.wait()
            wait = 0.5
            now = trio.current_time()
            members = self.members()
            if members != last_members:
                last_members, stable_since = members, now
            if self.leader() != self.peer_id or self.peer_id in self._leaving:
                continue  # not ours to plan (a node that is leaving plans nothing)
            serving = self.epoch is not None and not self.epoch.done.is_set()
            if serving and self._cut_off_since is None:
                await self._inform_joiners(members)
                continue
            if not serving:
                first = self.epoch is None
                if first and s.expect_peers and len(members) < s.expect_peers:
                    continue
                settle = s.settle_s if first and not s.expect_peers else REPLAN_SETTLE_S
                # let the transport's news of a dead peer arrive, and the membership settle
                ready_at = max(self._epoch_ended_at + REPLAN_SETTLE_S, stable_since + settle)
                if now < ready_at:
                    wait = ready_at - now
                    continue
            previous = None
            if self._cut_off_since is not None:
                try:
                    what, arg = await self._catch_up_as_leader(members, now, stable_since)
                except SwarmError as exc:
                    log.warning("catching up with the swarm failed: %s; trying again", exc)
                    continue
                if what == "wait":
                    wait = arg
                    continue
                if what == "done":
                    continue
                previous = arg
            try:
                await self._plan_and_start(self.plannable(), previous=previous)
            except PlanningError as exc:  # try again on news (a first RTT advertised, a peer joining)
                if str(exc) != self._planning_said:  # said once, then again only when it changes
                    self._planning_said = str(exc)
                    self._on_event(f"cannot plan yet: {exc}")
                    self.life("waiting", reason=str(exc))
                with trio.move_on_after(2.0):
                    await self._membership_changed.wait()
            except SwarmError as exc:
                self._on_event(f"epoch set-up failed: {exc}; retrying")
                if self.epoch is not None:
                    self._end_epoch(str(exc))
                await trio.sleep(REPLAN_SETTLE_S)

    def peers_file(self) -> dict[str, Any]:
        assert self.service is not None
        return self.service.membership.peers_file()

    def compute_plan(self, members: list[str], previous: Plan | None = None) -> Plan:
        """The next epoch's plan from our membership view, sticky with ``previous`` (default: our
        last epoch's plan).

        The coordinator is kept whenever it survives and can still be one (its generations in
        flight live on it: moving it would fail them); otherwise the planner's centroid rule picks.
        """
        if previous is None and self.epoch is not None:
            previous = self.epoch.plan
        epoch = max(previous.epoch if previous is not None else 0, self._last_epoch, self._newest_plan[0]) + 1
        self._last_epoch = epoch
        return self._plan_for(members, previous, epoch)

    def planning_problem(self) -> str | None:
        """Why the live members cannot hold the model right now (the planner's words), or None."""
        try:
            self._plan_for(self.plannable(), self.epoch.plan if self.epoch is not None else None, 0)
        except PlanningError as exc:
            return str(exc)
        return None

    def _plan_for(self, members: list[str], previous: Plan | None, epoch: int) -> Plan:
        pf = parse_peers_file(self.peers_file(), where="membership view")
        peers = [
            Peer(p.id, p.memory_bytes, p.ms_per_layer,
                 self.settings.coordinator_ok if p.id == self.peer_id else p.coordinator_ok, p.addresses)
            for p in pf.peers if p.id in members
        ]  # fmt: skip
        if previous is not None and previous.coordinator in members:
            keep = [dataclasses.replace(p, coordinator_ok=p.coordinator_ok and p.id == previous.coordinator) for p in peers]
            try:
                return make_plan(self.spec, keep, pf.latency(), previous=previous, epoch=epoch)
            except PlanningError:
                pass
        return make_plan(self.spec, peers, pf.latency(), previous=previous, epoch=epoch)

    async def _plan_and_start(self, members: list[str], previous: Plan | None = None) -> None:
        plan = self.compute_plan(members, previous)
        participants = sorted({plan.coordinator, *plan.ring})
        ended_at = None if self.epoch is None else self._epoch_ended_at
        cause = "first plan" if self.epoch is None else self._end_reason
        msg = sign_plan(PlanMsg(plan.epoch, plan_body(plan, cause)), self.identity, self.settings.swarm_id)
        self._planning_said = ""
        self._on_event(
            f"plan epoch {plan.epoch} ({cause[:120]}): coordinator {plan.coordinator[:16]}…, ring "
            + " -> ".join(f"{p[:10]}…{list(plan.blocks[p])}" for p in plan.ring)
        )
        others = [p for p in members if p not in participants]
        # every member learns the plan (a standby can then relay requests to the coordinator);
        # only the participants' answers gate the epoch
        t0 = trio.current_time()
        await self._phase(participants, msg, ctl.Loaded, LOAD_TIMEOUT_S, best_effort=others)
        t1 = trio.current_time()
        linked = await self._phase(participants, ctl.Connect(plan.epoch), ctl.Linked, LINK_TIMEOUT_S)
        t2 = trio.current_time()
        labels = {k: v for reply in linked.values() for k, v in reply.hops.items()}
        await self._phase([plan.coordinator], ctl.Serve(plan.epoch, labels), ctl.Serving, LINK_TIMEOUT_S)
        t3 = trio.current_time()
        since = "" if ended_at is None else f", {t3 - ended_at:.3f} s after the last one ended"
        log.info(
            "epoch %d set up: load %.3f s, connect %.3f s, serve %.3f s%s",
            plan.epoch, t1 - t0, t2 - t1, t3 - t2, since,
        )  # fmt: skip
        self._plan_msg, self._informed = msg, set(members)

    async def _catch_up_as_leader(self, members: list[str], now: float, stable_since: float) -> tuple[str, Any]:
        """Leading after being cut off (see the module docstring): let our view settle, then ask
        what the swarm serves. Returns ("wait", seconds) to look again later; ("done", None) when
        the epoch we hold is the swarm's (ours, or the one we just took as a standby); ("plan",
        previous) to plan sticky with ``previous`` (None: our own last epoch)."""
        cut_off = self._cut_off_since
        assert cut_off is not None
        patient = now - cut_off < CATCH_UP_WAIT_S
        settled_at = max(stable_since, cut_off) + CUT_OFF_SETTLE_S
        if patient and now < settled_at:
            return "wait", settled_at - now  # our view is still refilling (the others drop us, then take us back)
        newest, ended, answered = await self._catch_up(members)
        if patient and not answered and len(members) > 1:
            return "wait", 0.5  # nobody could tell us yet: our old connections are still being torn down
        ep = self.epoch
        serving = ep is not None and not ep.done.is_set()
        if newest is None and ended is not None:  # the swarm went past our epoch, and that ring ended too
            if serving:
                self._end_epoch(f"this node was cut off; the swarm went on to epoch {ended.epoch}, which ended")
            self._cut_off_since = None
            return "plan", ended
        if newest is None or (ep is not None and serving and newest.epoch <= ep.plan.epoch):
            self._cut_off_since = None
            return ("done", None) if serving else ("plan", None)
        plan = plan_from_body(newest.epoch, newest.plan)
        ring, live = {plan.coordinator, *plan.ring}, set(self.members())
        if ring <= live and self.peer_id not in ring:
            await self._accept_plan(plan.coordinator, newest, catching_up=True)  # ends our stale epoch
            self._plan_msg, self._informed, self._cut_off_since = newest, live, None
            self.notice(f"caught up: the swarm serves epoch {plan.epoch}; this node is a standby of it")
            return "done", None
        if not ring <= live and patient:
            return "wait", 0.5  # that ring's peers are still coming back into our view
        if serving:
            self._end_epoch(f"this node was cut off; the swarm went on to epoch {plan.epoch}")
        self._cut_off_since = None
        return "plan", plan

    async def _catch_up(self, members: list[str]) -> tuple[PlanMsg | None, Plan | None, int]:
        """What the other members serve: the newest serving epoch (a plan signed by a member)
        unless ours is newer; the newest ended one they report, if newer than ours; and how many
        answered. Bounded: a member that does not answer within CATCH_UP_TIMEOUT_S is not waited for."""
        found: list[PlanMsg] = []
        ended: list[Plan] = []
        answered = 0
        interim_leader = min((p for p in members if p != self.peer_id), default="")
        mine = self.epoch.plan.epoch if self.epoch is not None else 0

        async def ask(peer: str) -> None:
            try:
                msg = await self._ring_call(peer, ctl.Current(), CATCH_UP_TIMEOUT_S)
                nonlocal answered
                answered += 1
                if isinstance(msg, PlanMsg) and msg.signer is not None:
                    # only the peer that led this view while we were away may have signed it, or
                    # we did (we were cut off while not in the ring: the swarm still serves our plan)
                    signer = peer_id_of(msg.signer)
                    if signer not in (interim_leader, self.peer_id):
                        raise ProtocolError(
                            f"its plan epoch {msg.epoch} is signed by {signer}, not {interim_leader} nor us"
                        )
                    verify_plan(msg, msg.signer, self.settings.swarm_id)
                    check_epoch_step(msg.epoch, mine, f"plan shown by {peer}")
                    plan_from_body(msg.epoch, msg.plan)  # well-formed, or it is not taken
                    found.append(msg)
                elif isinstance(msg, ctl.NoPlan) and msg.plan is not None and msg.epoch is not None:
                    check_epoch_step(msg.epoch, mine, f"ended plan shown by {peer}")
                    ended.append(plan_from_body(msg.epoch, msg.plan))
            except (SwarmError, KeyError, TypeError, ValueError) as exc:
                log.info("catching up: %s did not say what it serves: %s", peer, exc)

        with trio.move_on_after(CATCH_UP_TIMEOUT_S + 1.0):
            async with trio.open_nursery() as nursery:
                for p in members:
                    if p != self.peer_id:
                        nursery.start_soon(ask, p)
        newest = max(found, key=lambda m: m.epoch, default=None)
        last_ended = max(ended, key=lambda p: p.epoch, default=None)
        return (
            newest if newest is not None and newest.epoch >= mine else None,
            last_ended if last_ended is not None and last_ended.epoch > mine else None,
            answered,
        )

    async def _inform_joiners(self, members: list[str]) -> None:
        """Leader: a peer that joined while a ring serves becomes a standby; it learns the plan
        (so it can relay requests to the coordinator) and the ring is left alone until the next
        re-plan, never changed in the middle of a generation."""
        msg = self._plan_msg
        new = [p for p in members if p not in self._informed]
        if msg is None or not new:
            return
        self._informed |= set(new)
        self._on_event(f"{len(new)} new peer(s) join as standbys of epoch {msg.epoch}")
        await self._phase([], msg, ctl.Loaded, RPC_TIMEOUT_S, best_effort=new)

    async def _phase(
        self, peers: list[str], msg: Message, want: type[R], timeout: float, best_effort: Sequence[str] = (),
    ) -> dict[str, R]:
        """Send ``msg`` to every peer, wait for a ``want`` reply from each; their replies."""
        name = getattr(msg, "OP", "plan")
        replies: dict[str, R] = {}

        async def maybe(peer: str) -> None:
            try:
                with trio.move_on_after(RPC_TIMEOUT_S):
                    await one(peer)
            except SwarmError as exc:
                log.info("standby %s did not take %s: %s", peer, name, exc)

        async def one(peer: str) -> None:
            if peer == self.peer_id:
                reply = await self.ring(self.peer_id, msg)
            else:
                reply = await self._ring_call(peer, msg, timeout)
            replies[peer] = ctl.expect(reply, want, peer, name)

        try:
            with trio.fail_after(timeout + 5):
                async with trio.open_nursery() as nursery:
                    for p in peers:
                        nursery.start_soon(one, p)
                    for p in best_effort:
                        nursery.start_soon(maybe, p)
        except trio.TooSlowError:
            raise PeerError(f"{name}: no answer from every peer within {timeout:.0f} s") from None
        except BaseExceptionGroup as eg:
            err = first_leaf(eg, SwarmError)
            if err is None:
                raise
            raise err from None
        return replies

    # -- every peer: the ring protocol ------------------------------------------------------

    async def _ring_call(self, peer: str, msg: Message, timeout: float = RPC_TIMEOUT_S) -> Message:
        """One request to ``peer`` on the ring protocol and its reply; opening the stream is
        bounded by RPC_TIMEOUT_S (or ``timeout`` if shorter), the reply by ``timeout``."""
        assert self.host is not None
        async with self.host.open_stream(peer, PROTO_RING, timeout=min(timeout, RPC_TIMEOUT_S)) as fs:
            await fs.send(msg.to_frame())
            return parse_message(await fs.receive(timeout=timeout))

    async def _serve_ring(self, peer: str, fs: FramedStream) -> None:
        frame = await fs.receive(timeout=RPC_TIMEOUT_S)
        try:
            msg = parse_message(frame)
        except ProtocolError as exc:
            await fs.send(ctl.fail_of(exc).to_frame())
            return
        reply = await self.ring(peer, msg)
        await fs.send(reply.to_frame())

    # the ring protocol's handlers (control.py checked the sender's role)

    async def _on_plan(self, peer: str, msg: PlanMsg) -> Message:
        await self._accept_plan(peer, msg)
        return ctl.Loaded(msg.epoch)

    async def _on_current(self, peer: str, msg: ctl.Current) -> Message:
        """What we serve, for a peer catching up (an ended epoch's plan still says who held what)."""
        ep = self.epoch
        if ep is not None and not ep.done.is_set() and ep.msg is not None:
            return ep.msg
        if ep is not None and ep.msg is not None:
            return ctl.NoPlan(ep.plan.epoch, ep.msg.plan)
        return ctl.NoPlan()

    async def _on_ended(self, peer: str, msg: ctl.Ended) -> Message:
        """A member's ring ended: are we behind?"""
        n = msg.epoch
        mine = self.epoch.plan.epoch if self.epoch is not None else 0
        check_epoch_step(n, mine, f"ended from {peer}")
        ep = self.epoch
        if n == mine and ep is not None and not ep.done.is_set() and self.leader() == self.peer_id:
            # a hop of our ring broke where we cannot see it (a relayed connection that
            # DCUtR replaced took its streams along): the ring cannot serve; re-plan
            self._end_epoch(f"{peer} reports that epoch {n} ended")
            return ctl.Serving()
        if n > mine and self.leader() == self.peer_id and self._cut_off_since is None:
            self.notice(f"{peer} served epoch {n}, newer than ours ({mine}): catching up with the swarm")
            self._cut_off_since = float("-inf")  # no settling: the swarm waits on us
            self._kick_leader()
        return ctl.Serving()

    async def _on_connect(self, peer: str, msg: ctl.Connect) -> Message:
        await self._connect(msg.epoch)
        return ctl.Linked({str(k): v for k, v in self.hop_labels(msg.epoch).items()})

    async def _on_leaving(self, peer: str, msg: ctl.Leaving) -> Message:
        """Never plan with it, nor take its plans."""
        self._leaving.add(peer)
        self._kick_leader()
        return ctl.Serving()

    async def _on_leave(self, peer: str, msg: ctl.Leave) -> Message:
        await self._handle_leave(peer)
        return ctl.Serving()

    async def _on_fault(self, peer: str, msg: ctl.Fault) -> Message:
        self._fault_report(peer, msg.peer, msg.epoch, msg.reason)
        return ctl.Serving()

    async def _on_serve(self, peer: str, msg: ctl.Serve) -> Message:
        await self._start_serving(msg.epoch, {int(k): v for k, v in msg.hops.items() if k.isdigit()})
        return ctl.Serving()

    # -- leaving on purpose ----------------------------------------------------------------

    async def leave(self, timeout: float = LEAVE_TIMEOUT_S) -> None:
        """Leave on purpose, within ``timeout`` whatever the others do.

        Every member first hears that we leave (``leaving``): none plans with us or takes a plan
        from us from then on, so a leaving leader hands leadership to the next smallest ID. If we
        hold part of the serving ring, the (new) leader is asked to re-plan without us (``leave``)
        and we wait until its new epoch is set up, so the generations in flight move to it (a
        short pause) instead of failing when we go. Bounded: after ``timeout`` we go anyway, and
        the swarm treats us as lost (it re-plans; generations resume by replay)."""
        others = [p for p in self.members() if p != self.peer_id]
        self._leaving.add(self.peer_id)
        self._kick_leader()
        ep = self.epoch
        in_ring = ep is not None and not ep.done.is_set() and self.peer_id in {*ep.plan.ring, ep.plan.coordinator}
        self.life("leaving", in_ring=in_ring, members=len(others))
        if not others:
            self.life("handover", result="alone: nobody to hand over to")
            return
        deadline = trio.current_time() + timeout
        with trio.move_on_after(min(timeout, LEAVING_NOTICE_S)):
            async with trio.open_nursery() as nursery:
                for p in others:
                    nursery.start_soon(self._tell_leaving, p)
        if not in_ring:
            self.life("handover", result="not in the ring: nothing to hand over")
            return
        leader = self.leader()
        if leader == self.peer_id:
            self.life("handover", result="every member is leaving")
            return
        self.notice(f"leaving: asking the leader {leader[:16]}… to re-plan without this node")
        try:
            with trio.fail_after(max(0.1, deadline - trio.current_time())):
                reply = await self._ring_call(leader, ctl.Leave(), timeout)
            if isinstance(reply, ctl.Fail):
                raise reply.error("the leader refused our leave: ")
            ctl.expect(reply, ctl.Serving, leader, "leave")
            self.life("handover", result="done", leader=leader)
        except trio.TooSlowError:
            self.notice(f"leaving without a hand-over (no new ring within {timeout:.0f} s)")
            self.life("handover", result=f"timed out after {timeout:.0f} s", leader=leader)
        except SwarmError as exc:
            self.notice(f"leaving without a hand-over ({exc})")
            self.life("handover", result=f"failed: {exc}", leader=leader)

    async def _tell_leaving(self, peer: str) -> None:
        try:
            await self._ring_call(peer, ctl.Leaving(), LEAVING_NOTICE_S)
        except SwarmError as exc:
            log.info("could not tell %s that we leave: %s", peer, exc)

    def start_swallowing(self) -> None:
        """Fault injection: this epoch's stage drops every frame it reads and the node stays up,
        answering heartbeats (a hop whose stream died silently, as a relayed one can). A new
        epoch's stage serves normally."""
        self.notice("fault injection: this node's stage drops what it receives in this epoch")
        if self.epoch is not None and self.epoch.worker is not None:
            self.epoch.worker.swallow = True

    def start_corrupting(self) -> None:
        """Fault injection for chaos tests: from now on our stage's outputs are NaN."""
        self.notice("fault injection: this node now sends NaN activations")
        self.corrupt = True
        if self.epoch is not None and self.epoch.worker is not None:
            self.epoch.worker.corrupt_after = 0

    async def report_fault(self, peer: str, reason: str, epoch: int) -> None:
        """Tell the leader that ``peer``, our upstream in ``epoch``, sent bad activations
        (bounded; best effort). See authority.py for what the leader makes of it."""
        self.notice(f"peer {peer} sent bad activations: reporting it to the leader ({_printable(reason)[:200]})")
        try:
            if self.leader() == self.peer_id:
                self._fault_report(self.peer_id, peer, epoch, reason)
                return
            with trio.fail_after(RPC_TIMEOUT_S):
                reply = await self._ring_call(self.leader(), ctl.Fault(peer, epoch, reason[:900]))
            if isinstance(reply, ctl.Fail):
                log.warning("the leader refused our report about %s: %s", peer, _printable(reply.message))
        except (SwarmError, trio.TooSlowError) as exc:
            log.warning("could not report %s to the leader: %s", peer, exc)

    def _fault_report(self, accuser: str, accused: str, epoch: int, reason: str) -> None:
        """Leader: weigh a report that ``accused`` sent ``accuser`` bad activations."""
        if self.leader() != self.peer_id:
            raise ProtocolError(f"{self.peer_id} is not the leader; ask {self.leader()}")
        ep = self.epoch
        if ep is None or ep.done.is_set():
            raise ProtocolError(f"fault report about epoch {epoch}: no epoch is serving here")
        check_fault_report(ep.plan, accuser, accused, epoch)
        spare_both = accuser != ep.plan.coordinator  # benching it would fail every session it holds
        if spare_both:
            try:
                self._plan_for([p for p in self.plannable() if p not in {accused, accuser}], ep.plan, 0)
            except PlanningError:
                spare_both = False
        verdict = self._claims.report(
            accuser, accused, leader=self.peer_id, now=trio.current_time(), spare_both=spare_both
        )
        why = f"{verdict.why}: {_printable(reason)[:300]}"
        for p in verdict.bench:
            self._exclude(p, why)

    def _exclude(self, peer: str, reason: str) -> None:
        """Leader: leave ``peer`` out of plans for EXCLUDE_S and re-plan now if it is in the ring."""
        log.warning("excluding %s from plans for %.0f s: %s", peer, EXCLUDE_S, _printable(reason))
        now = trio.current_time()
        self._excluded = {p: t for p, t in self._excluded.items() if t > now}  # bounded: expired go
        self._excluded[peer] = now + EXCLUDE_S
        ep = self.epoch
        if ep is not None and peer in {*ep.plan.ring, ep.plan.coordinator}:
            self._end_epoch(f"peer {peer} misbehaved: {reason[:200]}")

    async def _handle_leave(self, peer: str) -> None:
        """Leader: re-plan without ``peer``; return once an epoch without it is set up here
        (bounded by LEAVE_TIMEOUT_S: the leaver does not wait longer either)."""
        self._leaving.add(peer)
        if self.peer_id in self._leaving:
            raise PeerError(f"{self.peer_id} is leaving too")
        if self.leader() != self.peer_id:
            raise ProtocolError(f"{self.peer_id} is not the leader; ask {self.leader()}")
        problem = self.planning_problem()
        if problem is not None:  # the others cannot hold the model without it: no hand-over to wait for
            self._leaving.discard(peer)
            raise PlanningError(f"the swarm cannot re-plan without {peer}: {problem}")
        ep = self.epoch
        if ep is not None and peer in {*ep.plan.ring, ep.plan.coordinator}:
            self._end_epoch(f"peer {peer} is leaving")
        with trio.move_on_after(LEAVE_TIMEOUT_S):
            while True:
                ep = self.epoch
                if ep is not None and not ep.done.is_set() and peer not in {*ep.plan.ring, ep.plan.coordinator}:
                    return
                await trio.sleep(0.05)
        raise PeerTimeout(f"no ring without {peer} within {LEAVE_TIMEOUT_S:.0f} s")

    async def _serve_gen(self, peer: str, fs: FramedStream) -> None:
        from swarm.node.service import serve_gen

        await serve_gen(self, peer, fs)


def _listen_ip(listen: tuple[str, ...]) -> str:
    """The IP of the first /ip4 listen address (the fast path's direct socket binds there)."""
    for a in listen:
        parts = a.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "127.0.0.1"


def _announce(announce: tuple[str, ...], host: SwarmHost) -> list[str]:
    if not announce:
        return host.addrs()
    return [a if "/p2p/" in a else f"{a}/p2p/{host.peer_id}" for a in announce]


__all__ = ["Node", "NodeSettings", "hops"]


def _printable(text: str) -> str:
    """A peer's words, safe for one log line: control characters and lone surrogates escaped."""
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else f"\\x{{{ord(c):x}}}" for c in text)
