"""One plan epoch at a peer: taking the leader's plan, loading what it assigns, ending it.

Theory of operation
-------------------
An epoch's set-up is driven by the leader in three phases (leader.py); on PLAN, each peer checks
the leader's signature, ends the epoch it served, and loads its block (kept across epochs when
the block is unchanged) and, as coordinator, the head (this module); ``connect`` and ``serve``
wire the hops (wiring.py). A plan is taken only when it is newer than anything planned before:
an old plan stays old when the newer epoch ends, so a replayed one is never taken again.

Every task of an epoch runs until the epoch ends (``Epoch.done``), and reports its own failure
with ``end(..., only=ep)``: a stale report from an epoch already replaced changes nothing, so
tearing down old links can never end the epoch that replaced them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from swarm.errors import PeerError, ProtocolError
from swarm.model.stage import Stage
from swarm.node.compute import memory
from swarm.node.compute.runtime import Models
from swarm.node.errors_util import unwrap
from swarm.node.notices import Notices
from swarm.node.ring.capacity import SlotQueue, ring_capacity
from swarm.node.ring.coordinator import Coordinator
from swarm.node.ring.links import Link
from swarm.node.ring.stage_worker import StageWorker
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import verify_plan
from swarm.proto.signing import peer_id_of

log = logging.getLogger("swarm.node")

MAX_CAUSE = 300
T = TypeVar("T")


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
    outbound_ready: trio.Event = field(default_factory=trio.Event)  # set with ``outbound``
    done: trio.Event = field(default_factory=trio.Event)
    serving: trio.Event = field(default_factory=trio.Event)
    started: float = field(default_factory=time.time)
    cause: str = ""  # the leader's words for why this epoch was planned (signed with the plan)
    msg: PlanMsg | None = None  # the signed plan as received (a peer catching up is shown it)
    phases: set[str] = field(default_factory=set)  # set-up steps taken ("connect", "serve"): once each
    hop_labels: dict[int, str] = field(default_factory=dict)  # hop -> "direct", "hole-punched", "relayed via …"
    # stage peer -> how it runs its decode steps (compiled spans or eager and why: control.StageRun), as
    # the leader's serve passed on each stage's loaded reply; for receipts
    compiled: dict[str, dict[str, Any]] = field(default_factory=dict)

    def wait_inbound(self, hop: int) -> trio.Event:
        return self.inbound_ready.setdefault(hop, trio.Event())

    @property
    def members(self) -> set[str]:
        """The peers whose loss ends this epoch: the coordinator and the ring."""
        return {self.plan.coordinator, *self.plan.ring}

    @property
    def live(self) -> bool:
        return not self.done.is_set()

    async def until_done(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` until it returns or the epoch ends; its own error comes out unwrapped."""
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await self.done.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await fn()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None


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
        **({"draft": 1} if plan.draft else {}),  # the coordinator runs its draft model (budgeted)
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
            "draft": body.get("draft", 0) == 1,
        }
    )


def hops(plan: Plan) -> list[tuple[str, str]]:
    """The traversal's hops in order: coordinator -> ring[0] -> ... -> ring[-1] -> coordinator.
    Hop i enters ring[i]; the last hop enters the coordinator."""
    path = [plan.coordinator, *plan.ring, plan.coordinator]
    return [(path[i], path[i + 1]) for i in range(len(path) - 1)]


class Epochs:
    """The epoch this node serves, the newest plan it took, and why epochs ended.

    ``leader``: who leads this node's view (a plan is taken only when that peer signed it);
    ``memory``: each member's offered memory (the ring's capacity); ``on_end(ep)`` runs when an
    epoch ends (the composition root, serving.py, hands recovery each ended epoch through a
    channel); ``cannot_load(a, b, coordinator)`` lowers this peer's offer after a block did not
    fit and returns the new offer."""

    def __init__(
        self,
        settings: NodeSettings,
        peer_id: str,
        models: Models,
        admission: SlotQueue,
        notices: Notices,
        *,
        leader: Callable[[], str],
        memory: Callable[[], dict[str, int]],
        drafts: Callable[[], dict[str, int]] = dict,
        widths: Callable[[], dict[str, int]] = dict,
        on_end: Callable[[Epoch], None] = lambda ep: None,
        cannot_load: Callable[[int, int, bool], int] | None = None,
    ) -> None:
        self.settings = settings
        self.peer_id = peer_id
        self.models = models
        self.admission = admission
        self.notices = notices
        self.leader = leader
        self.memory = memory
        self.drafts = drafts  # each member's advertised draft model bytes (the planner's coordinator part)
        self.widths = widths  # each member's advertised value width (the planner's Peer.dtype_bytes)
        self.on_end = on_end
        self.cannot_load = cannot_load  # a block that did not fit: lower our offer, return the new one
        self.current: Epoch | None = None
        self.previous: Epoch | None = None  # the epoch the current one replaced (fault reports may name it)
        self.newest: tuple[int, bytes | None] = (0, None)  # (epoch, signature) of the newest plan taken
        self.ended_at = -1e9  # trio time the last epoch ended
        self.end_reason = ""  # ... and why (the next plan carries it as its cause)
        self.replans: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)  # epoch ends, for status
        self._changed = trio.Event()  # set, and replaced, whenever an epoch is taken, serves or ends

    def notify(self) -> None:
        """Wake the waiters of :meth:`wait_for` (accept, end and mark_serving call it)."""
        self._changed.set()
        self._changed = trio.Event()

    def mark_serving(self, ep: Epoch) -> None:
        """``ep``'s coordinator serves (its result link is open): waiters on it wake."""
        ep.serving.set()
        self.notify()

    async def wait_for(self, ready: Callable[[], T | None], timeout: float) -> T | None:
        """``ready()``'s first value that is not None, checked now and again each time an epoch is
        taken, starts serving or ends (never by polling); None if none came within ``timeout``
        (one that is already past, as a deadline computed before slow work makes it: checked once)."""
        with trio.move_on_after(max(0.0, timeout)):
            while True:
                value = ready()
                if value is not None:
                    return value
                await self._changed.wait()
        return None

    @property
    def serving(self) -> Epoch | None:
        """The current epoch if it has not ended."""
        ep = self.current
        return ep if ep is not None and ep.live else None

    def get(self, epoch: int) -> Epoch:
        """Epoch ``epoch`` if it is the live current one; ProtocolError otherwise."""
        ep = self.current
        if ep is None or ep.plan.epoch != epoch or ep.done.is_set():
            have = None if ep is None else ep.plan.epoch
            raise ProtocolError(f"epoch {epoch} is not current here (current: {have})")
        return ep

    def known(self, epoch: int) -> Epoch | None:
        """Epoch ``epoch`` if it is the current one here or the one it replaced."""
        for ep in (self.current, self.previous):
            if ep is not None and ep.plan.epoch == epoch:
                return ep
        return None

    def roles(self, epoch: int) -> tuple[str | None, set[str]]:
        """(the plan's signer if ``epoch`` is the live current one, else None; the coordinator and
        ring of ``epoch``, the current one here or the one it replaced: a stage reporting a fault
        in the ring that just ended is still that ring's stage). ProtocolError for any other."""
        ep = self.known(epoch)
        if ep is None:
            have = None if self.current is None else self.current.plan.epoch
            raise ProtocolError(f"epoch {epoch} is not current here (current: {have})")
        signer = peer_id_of(ep.signer) if ep is self.current and ep.live else None
        return signer, ep.members

    async def accept(
        self, sender: str, msg: PlanMsg, *, catching_up: bool = False, taken: Callable[[], None] = lambda: None
    ) -> Epoch:
        """Take the leader's plan: signed by it, or passed on by it as it was signed (the ring it
        leads was planned by a leader that has left since: a newcomer learns it as a standby).
        ``catching_up``: a plan the swarm already serves, which this node, back from being cut
        off, was shown by a member; its signer need not lead here. ``taken()`` runs once the plan
        is taken, before its block loads (leader.Leader.took_plan)."""
        if msg.signer is None:
            raise ProtocolError(f"plan epoch {msg.epoch} from {sender} is unsigned")
        verify_plan(msg, msg.signer, self.settings.swarm_id)
        signer_id = peer_id_of(msg.signer)
        if signer_id != self.leader() and sender != self.leader() and not catching_up:
            raise ProtocolError(f"plan epoch {msg.epoch} signed by {signer_id}, but the leader here is {self.leader()}")
        try:
            plan = plan_from_body(msg.epoch, msg.plan)
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"plan epoch {msg.epoch} from {sender}: missing field {exc}") from None
        cur = self.current
        if cur is not None and plan.epoch <= cur.plan.epoch and not cur.done.is_set():
            raise ProtocolError(f"plan epoch {plan.epoch} is not newer than the serving epoch {cur.plan.epoch}")
        newest, signature = self.newest
        if plan.epoch < newest or (plan.epoch == newest and msg.signature != signature):
            # an old plan stays old when the newer epoch ends: it is never taken again
            raise ProtocolError(f"plan epoch {plan.epoch} from {sender}: epoch {newest} was planned already")
        self.newest = (plan.epoch, msg.signature)
        ended_at = self.ended_at if cur is not None and cur.done.is_set() else None
        if cur is not None:
            self.end(f"replaced by epoch {plan.epoch}")
        cause = msg.plan.get("cause", "")
        ep = Epoch(plan, msg.signer, cause=cause[:MAX_CAUSE] if isinstance(cause, str) else "", msg=msg)
        self.previous, self.current = cur, ep
        self.notify()
        taken()
        me = self.peer_id
        role = "+".join(r for r, on in (("coordinator", plan.coordinator == me),
                                         ("stage", me in plan.blocks)) if on) or "standby"  # fmt: skip
        pause = None if ended_at is None else trio.current_time() - ended_at
        if pause is not None and self.replans:  # the ended epoch's entry learns what replaced it, and when
            self.replans[-1].update(next_epoch=plan.epoch, cause=ep.cause, pause_s=round(pause, 3))
        self.notices.life("plan", epoch=plan.epoch, role=role, block=list(plan.blocks.get(me, ())) or None,
                          coordinator=plan.coordinator, ring=list(plan.ring), cause=ep.cause,
                          pause_s=None if pause is None else round(pause, 3))  # fmt: skip
        if cur is not None and cur.plan.blocks.get(me) != plan.blocks.get(me):
            # the ended epoch lets go of its block before the new one loads (Models.stage drops its
            # own reference): a re-plan that moves blocks never holds both (a worker still in its
            # last forward keeps the old one until that returns)
            cur.stage = cur.worker = None
        if me in plan.blocks:
            ep.stage = await self._load(*plan.blocks[me], coordinator=plan.coordinator == me)
        if plan.coordinator == me:
            s = self.settings
            head = await self.models.head()
            ep.coordinator = Coordinator(
                head, epoch=plan.epoch, first_hop=plan.ring[0], chunk_timeout=s.chunk_timeout,
                compute=self.models.compute, compute_delay_s=s.compute_delay_s, max_len=self.models.context_tokens,
            )  # fmt: skip
            # how many generations the ring's KV memory holds (capacity.py)
            self.admission.set_capacity(ring_capacity(self.models.spec, plan, self.memory(), self.drafts(),
                                                        self.widths()))
            await self.models.load_tokenizer()
            await self.models.drafts.use(plan.draft, head=head, ckpt=self.models.ckpt, dtype=self.models.dtype,
                                         device=s.device, tokenizer=self.models.tokenizer,
                                         notice=self.notices.event)  # its draft model (drafting.py)  # fmt: skip
        return ep

    async def _load(self, a: int, b: int, *, coordinator: bool) -> Stage:
        """Our planned block (Models.stage). One that does not fit lowers our offer first, so the
        leader's next plan gives us less, and says so (nobody is blamed: compute/memory.py)."""
        try:
            return await self.models.stage(a, b)
        except memory.CannotLoad as exc:
            if self.cannot_load is None:
                raise
            offer = self.cannot_load(a, b, coordinator)
            self.notices.event(f"{exc}; now offering {memory.size(offer)}")
            raise memory.CannotLoad(f"{exc}; this peer now offers {memory.size(offer)}") from None

    def end(self, reason: str, *, only: Epoch | None = None) -> None:
        """End the current epoch. ``only``: a task of that epoch is reporting its own failure;
        if a newer epoch has replaced it meanwhile, the report is stale and changes nothing
        (an old link torn down must never end the epoch that replaced it)."""
        ep = self.current
        if only is not None and ep is not only:
            return
        if ep is None or ep.done.is_set():
            return
        log.info("epoch %d ends: %s", ep.plan.epoch, reason)
        self.end_reason = reason
        self.replans.append({"epoch": ep.plan.epoch, "ended": time.time(), "reason": reason})
        if ep.coordinator is not None:
            ep.coordinator._fail_all(PeerError(f"epoch {ep.plan.epoch} ended: {reason}"))
        self.ended_at = trio.current_time()
        ep.done.set()
        self.notify()
        self.notices.life("replan", ended_epoch=ep.plan.epoch, cause=reason[:300])
        self.on_end(ep)
