"""The leader: who plans, when, and how a plan epoch is set up; catching up after a cut-off.

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

``connect`` and ``serve`` wait for every answer (at most ``authority.CONNECT_REPLY_S``), none cut
short by another's failure: when one fails, the leader strikes whom its own evidence blames (a
member silent to it, a door its own probe cannot open either: ``authority.setup_blame``), never
a peer on its neighbour's word, and the set-up is retried; STRIKES such failures bench a member.

A peer that was cut off (stopped, asleep: its heartbeat clock jumped; or it saw every other
member go) may be the smallest ID again when it comes back, but its view is stale: the others
re-planned without it, and its view churns while they drop and re-admit it. Before it plans,
such a peer (and a fresh one) lets its view settle (CUT_OFF_SETTLE_S, at most CATCH_UP_WAIT_S)
and asks the members what they serve (``current``), even while it still holds an epoch of its
own: if they serve a newer one whose ring is all in its view, it takes that epoch as a standby
and leads from there, so coming back never moves the coordinator or disturbs a run; otherwise it
plans sticky with the swarm's epoch, not its own. As a fallback, a member whose ring ended and
that sees no new plan within NUDGE_AFTER_S tells the leader which epoch ended (``ended``,
recovery.py): a leader that finds it is behind catches up the same way, so the swarm never waits
on it forever.

The coordinator of a fresh plan is chosen with the other members' claims about memory, speed
and drafts bounded (authority.py: a claim nobody measured must not draw the role that sees every
prompt); the layers are then placed on the claims as made, with that coordinator pinned.

We chose leader-signs-and-distributes over "everyone computes the plan from one snapshot": RTTs
are measured by each peer and change all the time, so identical snapshots would need a consensus
round anyway; with a leader, a plan is computed once and every peer can check who signed it.

When. The leader plans once the expected number of members is present (``expect_peers``, used by
the demo) or, without it, once membership has been stable for ``settle_s`` and the members can
hold the model. A peer that joins later becomes a standby: the ring is never re-planned while it
serves. A lost ring member ends the epoch and the leader plans the next one from the survivors
(sticky: they keep their blocks where they can); the coordinator's generations pause and resume on
the new ring by replaying what they had fed it (resume.py), so no token is lost or changed. A
plan that cannot be made yet (too little memory, an edge nobody has measured) is retried on the
next membership news.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm.errors import Forbidden, PeerError, PlanningError, SwarmError
from swarm.node.dispatch import RingClient
from swarm.node.members.failure import DEFAULT_LOST_AFTER, MAX_PATIENCE
from swarm.node.members.view import MemberView
from swarm.node.notices import Notices
from swarm.node.plan.authority import (
    CONNECT_REPLY_S,
    DOOR_PROBE_S,
    ENDED_EVERY_S,
    bounded_coordinator,
    bounded_draft_claims,
    check_epoch_end,
    check_epoch_step,
    doors_to_probe,
    setup_blame,
    vouched_plans,
)
from swarm.node.plan.bench import Bench
from swarm.node.plan.epochs import Epochs, plan_body, plan_from_body
from swarm.node.settings import NodeSettings
from swarm.planner import ModelSpec, Peer, Plan, parse_peers_file
from swarm.planner import plan as make_plan
from swarm.proto import control as ctl
from swarm.proto.messages import Message
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import sign_plan, verify_plan
from swarm.proto.signing import Signer

log = logging.getLogger("swarm.node")

INFORM_TIMEOUT_S = 20.0
REPLAN_SETTLE_S = 0.15  # after an epoch ended: re-plan as soon as membership stops changing
# ... when membership has lost one of its members since: the view is already what the plan is
# made from (an end with every member still in the view, e.g. a generation that failed on a
# stage's error, may have a fault report or the loss itself on its way: 0.05 s for every end
# made test_nan_activations re-plan twice, the fault report arriving after the first plan)
LOSS_SETTLE_S = 0.05
# after an epoch ended, a re-plan waits for a suspect peer's verdict at most as long as the
# detector may take to give it (a peer that flapped before is allowed more silence: failure.py)
VERDICT_WAIT_S = DEFAULT_LOST_AFTER * MAX_PATIENCE
CATCH_UP_TIMEOUT_S = 2.0  # a peer back from being cut off asks the others what they serve
CATCH_UP_WAIT_S = 3.0  # ... and waits at most this long for its view to settle / that ring to reappear
CUT_OFF_SETTLE_S = 1.0  # ... the view it catches up from has been unchanged this long


class Leader:
    """Plans epochs when this node leads its view (see the module docstring)."""

    def __init__(
        self,
        settings: NodeSettings,
        signer: Signer,
        view: MemberView,
        epochs: Epochs,
        ring: RingClient,
        spec: ModelSpec,
        notices: Notices,
        *,
        peers_file: Callable[[], dict[str, Any]],
        catch_stall: Callable[[], None] = lambda: None,
        door_open: Callable[[str, float], Awaitable[bool]] | None = None,
    ) -> None:
        self.settings = settings
        self.catch_stall = catch_stall  # heartbeat.Liveness.catch_stall: were we stopped just now?
        self.door_open = door_open  # wiring.Wiring.door_open: our own probe of a member's activation door
        self.signer = signer
        self.peer_id = view.peer_id
        self.view = view
        self.epochs = epochs
        self.ring = ring
        self.spec = spec
        self.notices = notices
        self.peers_file = peers_file
        self._last_epoch = 0  # the highest epoch this node has proposed (never reused)
        self._planning_said = ""  # the last "cannot plan yet" reason shown
        self._plan_msg: PlanMsg | None = None  # the leader's signed plan of the serving epoch
        self._informed: set[str] = set()  # members that were sent it
        # trio time our view of the epochs went stale (None: it is not); a new node's is unknown
        # (-inf: it asks the members what they serve before its first plan, without waiting)
        self.cut_off_since: float | None = float("-inf")
        self.benches = Bench(self.peer_id, view, epochs)  # strikes and the bench (bench.py)

    def cut_off(self) -> None:
        """Our view went stale now (we were stopped, or saw every other member go)."""
        self.cut_off_since = trio.current_time()
        self.view.kick()

    def took_plan(self) -> None:
        if self.cut_off_since == float("-inf"):
            self.cut_off_since = None  # a new node that took a plan knows the swarm's epoch now

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        last_members: list[str] = []
        stable_since = trio.current_time()
        wait = 0.5  # until the next look, unless woken: exact when a settle time is running out
        while True:
            await self.view.changed(wait)
            wait = 0.5
            self.catch_stall()  # a node back from a stop marks its view stale before it decides anything
            now = trio.current_time()
            members = self.view.members()
            if members != last_members:
                last_members, stable_since = members, now
            if self.view.leader() != self.peer_id or self.peer_id in self.view.leaving:
                continue  # not ours to plan (a node that is leaving plans nothing)
            serving = self.epochs.serving is not None
            cause = None
            if serving and self.cut_off_since is None:
                if not await self._inform_joiners(members):
                    continue
                cause = "a partition healed: one epoch for the whole swarm"
            if not serving:
                first = self.epochs.current is None
                if first and s.expect_peers and len(members) < s.expect_peers:
                    continue
                ended = self.epochs.current  # the epoch that ended (None: none yet)
                lost = ended is not None and any(p not in members for p in ended.members)
                after_end = LOSS_SETTLE_S if lost else REPLAN_SETTLE_S
                settle = s.settle_s if first and not s.expect_peers else after_end
                # let the transport's news of a dead peer arrive, and the membership settle
                ready_at = max(self.epochs.ended_at + after_end, stable_since + settle)
                if now < ready_at:
                    wait = ready_at - now
                    continue
                # A run that timed out can end its epoch before the failure detector has judged
                # the peer that went quiet (a frozen peer is suspect first, lost a second later):
                # a plan made now would keep that peer and fail again at set-up. Wait, bounded,
                # for the verdict: lost (planned around) or heard again (planned with).
                if not first and self.view.suspects() and now < self.epochs.ended_at + VERDICT_WAIT_S:
                    wait = 0.1
                    continue
            previous = None
            if self.cut_off_since is not None:
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
                await self.plan_and_start(self.view.plannable(), previous=previous, cause=cause)
            except PlanningError as exc:  # try again on news (a first RTT advertised, a peer joining)
                if str(exc) != self._planning_said:  # said once, then again only when it changes
                    self._planning_said = str(exc)
                    self.notices.event(f"cannot plan yet: {exc}")
                    self.notices.life("waiting", reason=str(exc))
                await self.view.changed(2.0)
            except SwarmError as exc:
                self.notices.event(f"epoch set-up failed: {exc}; retrying")
                self.epochs.end(str(exc))
                await trio.sleep(REPLAN_SETTLE_S)

    # -- planning ---------------------------------------------------------------------------

    def compute_plan(self, members: list[str], previous: Plan | None = None) -> Plan:
        """The next epoch's plan from our membership view, sticky with ``previous`` (default: our
        last epoch's plan).

        The coordinator is kept whenever it survives and can still be one (its generations in
        flight live on it: moving it would fail them); otherwise the planner's centroid rule picks.
        """
        cur = self.epochs.current
        if previous is None and cur is not None:
            previous = cur.plan
        epoch = max(previous.epoch if previous is not None else 0, self._last_epoch, self.epochs.newest[0]) + 1
        self._last_epoch = epoch
        return self.plan_for(members, previous, epoch)

    def planning_problem(self) -> str | None:
        """Why the live members cannot hold the model right now (the planner's words), or None."""
        cur = self.epochs.current
        try:
            self.plan_for(self.view.plannable(), cur.plan if cur is not None else None, 0)
        except PlanningError as exc:
            return str(exc)
        return None

    def plan_for(self, members: list[str], previous: Plan | None, epoch: int) -> Plan:
        """The plan of ``members`` for ``epoch``. The coordinator is the previous one when it
        survives and can still be one; otherwise it is chosen with the other members' claims
        bounded (authority.bounded_coordinator: a claim of 0.001 ms per layer or 10 TB no longer
        draws the role that sees every prompt). The layers are then placed on the claims as
        made, the coordinator pinned: honest members differ tenfold, and so do their shares."""
        pf = parse_peers_file(self.peers_file(), where="membership view")
        peers = bounded_draft_claims([
            dataclasses.replace(p, coordinator_ok=self.settings.coordinator_ok if p.id == self.peer_id else p.coordinator_ok)
            for p in pf.peers if p.id in members
        ], self.peer_id)  # fmt: skip
        lat = pf.latency()

        def pinned(coordinator: str) -> list[Peer]:
            return [dataclasses.replace(p, coordinator_ok=p.coordinator_ok and p.id == coordinator) for p in peers]

        if previous is not None and previous.coordinator in members:
            try:
                return make_plan(self.spec, pinned(previous.coordinator), lat, previous=previous, epoch=epoch)
            except PlanningError:
                pass
        coordinator = bounded_coordinator(self.spec, peers, lat, self.peer_id, previous=previous, epoch=epoch)
        return make_plan(self.spec, pinned(coordinator), lat, previous=previous, epoch=epoch)

    async def plan_and_start(self, members: list[str], previous: Plan | None = None, cause: str | None = None) -> None:
        plan = self.compute_plan(members, previous)
        participants = sorted({plan.coordinator, *plan.ring})
        ended_at = None if self.epochs.current is None else self.epochs.ended_at
        if cause is None:
            cause = "first plan" if self.epochs.current is None else self.epochs.end_reason
        msg = sign_plan(PlanMsg(plan.epoch, plan_body(plan, cause)), self.signer, self.settings.swarm_id)
        self._planning_said = ""
        self.notices.event(
            f"plan epoch {plan.epoch} ({cause[:120]}): coordinator {plan.coordinator[:16]}…, ring "
            + " -> ".join(f"{p[:10]}…{list(plan.blocks[p])}" for p in plan.ring)
        )
        others = [p for p in members if p not in participants]
        # every member learns the plan (a standby can then relay requests to the coordinator);
        # only the participants' answers gate the epoch
        t0 = trio.current_time()
        # each participant's whole load (fetch, load, compile: NodeSettings.load_timeout_s, whose half
        # bounds a compiling node's warm-up, runtime.warm_within)
        loaded = await self.ring.phase(participants, msg, ctl.Loaded, self.settings.load_timeout_s, best_effort=others)
        # how each stage runs (compiled spans or eager, and why): the coordinator's receipts name it
        compiled = {p: r.compiled for p, r in loaded.items() if r.compiled is not None and p in plan.blocks}
        t1 = trio.current_time()
        answers, linked, errors = await self.ring.ask_each(participants, ctl.Connect(plan.epoch), ctl.Linked, CONNECT_REPLY_S)
        if errors:
            await self._blame_setup(plan, answers)
            raise PeerError(f"connect of epoch {plan.epoch}: " + "; ".join(errors))
        t2 = trio.current_time()
        labels = {k: v for reply in linked.values() for k, v in reply.hops.items()}
        served, _replies, errors = await self.ring.ask_each([plan.coordinator], ctl.Serve(plan.epoch, labels, compiled or None),
                                                             ctl.Ack, CONNECT_REPLY_S)  # fmt: skip
        if errors:
            await self._blame_setup(plan, answers, serve="served" if served[plan.coordinator] == "linked" else served[plan.coordinator])
            raise PeerError(f"serve of epoch {plan.epoch}: " + "; ".join(errors))
        t3 = trio.current_time()
        since = "" if ended_at is None else f", {t3 - ended_at:.3f} s after the last one ended"
        log.info(
            "epoch %d set up: load %.3f s, connect %.3f s, serve %.3f s%s",
            plan.epoch, t1 - t0, t2 - t1, t3 - t2, since,
        )  # fmt: skip
        self._plan_msg, self._informed = msg, set(members)

    async def _blame_setup(self, plan: Plan, answers: dict[str, str], serve: str | None = None) -> None:
        """A set-up failed: strike whom the leader's own evidence blames (``authority.setup_blame``),
        after probing the door of every peer a failed hop entered. A peer the failure detector
        lost or suspects meanwhile is left to it (a crash, a freeze: not a strike)."""
        doors: dict[str, bool] = {}
        if self.door_open is not None:
            probe = self.door_open

            async def check(peer: str) -> None:
                doors[peer] = await probe(peer, DOOR_PROBE_S)

            async with trio.open_nursery() as nursery:
                for p in sorted(doors_to_probe(plan, self.peer_id, answers)):
                    nursery.start_soon(check, p)
        live = set(self.view.members()) - set(self.view.suspects())
        for peer, why in setup_blame(plan, self.peer_id, answers, doors, serve).items():
            if peer in live:
                log.warning("set-up of epoch %d failed: a strike against %s: %s", plan.epoch, peer, why)
                self.benches.strike(peer, why)

    async def _inform_joiners(self, members: list[str]) -> bool:
        """A peer that joined while a ring serves becomes a standby; it learns the plan (so it
        can relay requests to the coordinator) and the ring is left alone until the next
        re-plan, never changed in the middle of a generation.

        Unless the newcomers serve a ring of their own: two halves of a partition that each
        could hold the model each planned one, and now they meet. Then one epoch for the whole
        swarm is planned, newer than both (True: the caller plans it now), sticky with ours; the
        generations of either ring resume on it (resume.py, service.py), none fails."""
        msg = self._plan_msg
        ep = self.epochs.serving
        if msg is None and ep is not None and ep.msg is not None:
            # we lead a ring another leader planned (it left, and was not in the ring): we tell
            # newcomers its plan as it was signed (epochs.accept takes a plan its leader passes on)
            msg = self._plan_msg = ep.msg
            self._informed = {self.peer_id}
        self._informed &= set(members)  # one that was lost and comes back is told again
        new = [p for p in members if p not in self._informed]
        if msg is None or not new:
            return False
        answered, foreign, holding = await self._rings_of(new, msg)
        self._informed |= answered
        if foreign:
            self._last_epoch = max(self._last_epoch, *foreign.values())
            self.notices.notice(
                f"{len(foreign)} peer(s) serve another ring (epoch {max(foreign.values())}; a partition healed?): "
                "planning one epoch for the whole swarm"
            )
            return True
        joiners = sorted(answered - holding)
        if joiners:
            self.notices.event(f"{len(joiners)} new peer(s) join as standbys of epoch {msg.epoch}")
            await self.ring.phase([], msg, ctl.Loaded, INFORM_TIMEOUT_S, best_effort=joiners)
        return False

    async def _rings_of(self, peers: list[str], ours: PlanMsg) -> tuple[set[str], dict[str, int], set[str]]:
        """Ask ``peers`` what they serve: those that answered, the epoch of each that serves a
        ring other than ours (a plan validly signed for this swarm, within the epoch step), and
        those that hold ours already."""
        answered: set[str] = set()
        foreign: dict[str, int] = {}
        holding: set[str] = set()

        async def ask(peer: str) -> None:
            try:
                reply = await self.ring.call(peer, ctl.Current(), CATCH_UP_TIMEOUT_S)
                answered.add(peer)
                if isinstance(reply, PlanMsg) and reply.signature == ours.signature:
                    holding.add(peer)
                elif isinstance(reply, PlanMsg) and reply.signer is not None:
                    verify_plan(reply, reply.signer, self.settings.swarm_id)
                    check_epoch_step(reply.epoch, ours.epoch, f"plan shown by {peer}")
                    foreign[peer] = reply.epoch
            except SwarmError as exc:
                log.info("could not ask %s what it serves: %s", peer, exc)

        with trio.move_on_after(CATCH_UP_TIMEOUT_S + 1.0):
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(ask, p)
        return answered, foreign, holding

    # -- catching up after a cut-off ------------------------------------------------------------

    async def _catch_up_as_leader(self, members: list[str], now: float, stable_since: float) -> tuple[str, Any]:
        """Leading after being cut off (see the module docstring): let our view settle, then ask
        what the swarm serves. Returns ("wait", seconds) to look again later; ("done", None) when
        the epoch we hold is the swarm's (ours, or the one we just took as a standby); ("plan",
        previous) to plan sticky with ``previous`` (None: our own last epoch)."""
        cut_off = self.cut_off_since
        assert cut_off is not None
        patient = now - cut_off < CATCH_UP_WAIT_S
        settled_at = max(stable_since, cut_off) + CUT_OFF_SETTLE_S
        if patient and now < settled_at:
            return "wait", settled_at - now  # our view is still refilling (the others drop us, then take us back)
        newest, ended, answered = await self._catch_up(members)
        if patient and not answered and len(members) > 1:
            return "wait", 0.5  # nobody could tell us yet: our old connections are still being torn down
        ep = self.epochs.current
        serving = self.epochs.serving is not None
        if newest is None and ended is not None:  # the swarm went past our epoch, and that ring ended too
            if serving:
                self.epochs.end(f"this node was cut off; the swarm went on to epoch {ended.epoch}, which ended")
            self.cut_off_since = None
            return "plan", ended
        if newest is None or (ep is not None and serving and newest.epoch <= ep.plan.epoch):
            self.cut_off_since = None
            return ("done", None) if serving else ("plan", None)
        plan = plan_from_body(newest.epoch, newest.plan)
        ring, live = {plan.coordinator, *plan.ring}, set(self.view.members())
        if ring <= live and self.peer_id not in ring:
            await self.epochs.accept(plan.coordinator, newest, catching_up=True)  # ends our stale epoch
            self._plan_msg, self._informed, self.cut_off_since = newest, live, None
            self.notices.notice(f"caught up: the swarm serves epoch {plan.epoch}; this node is a standby of it")
            return "done", None
        if not ring <= live and patient:
            return "wait", 0.5  # that ring's peers are still coming back into our view
        if serving:
            self.epochs.end(f"this node was cut off; the swarm went on to epoch {plan.epoch}")
        self.cut_off_since = None
        return "plan", plan

    async def _catch_up(self, members: list[str]) -> tuple[PlanMsg | None, Plan | None, int]:
        """What the other members serve: the newest serving epoch unless ours is newer; the newest
        ended one they report, if newer than ours; and how many answered. Only plans that
        ``authority.vouched_plans`` lets through count (signed by the peer that led this view
        while we were away, or by us; verified; held by a member other than their signer).
        Bounded: a member that does not answer within CATCH_UP_TIMEOUT_S is not waited for."""
        shown: list[tuple[str, PlanMsg]] = []
        served: set[bytes] = set()  # signatures of the plans some member still serves
        answered = 0
        interim_leader = min((p for p in members if p != self.peer_id), default="")
        mine = self.epochs.current.plan.epoch if self.epochs.current is not None else 0

        async def ask(peer: str) -> None:
            nonlocal answered
            try:
                msg = await self.ring.call(peer, ctl.Current(), CATCH_UP_TIMEOUT_S)
                answered += 1
                plan = msg.signed_plan() if isinstance(msg, ctl.NoPlan) else msg
                if isinstance(plan, PlanMsg):
                    plan_from_body(plan.epoch, plan.plan)  # well-formed, or it is not taken
                    shown.append((peer, plan))
                    if plan is msg and plan.signature is not None:
                        served.add(plan.signature)
            except (SwarmError, KeyError, TypeError, ValueError) as exc:
                log.info("catching up: %s did not say what it serves: %s", peer, exc)

        with trio.move_on_after(CATCH_UP_TIMEOUT_S + 1.0):
            async with trio.open_nursery() as nursery:
                for p in members:
                    if p != self.peer_id:
                        nursery.start_soon(ask, p)
        taken, refused = vouched_plans(
            shown, leaders={interim_leader, self.peer_id}, me=self.peer_id, swarm_id=self.settings.swarm_id,
            newest_known=mine,
        )  # fmt: skip
        for why in refused:
            log.warning("catching up: not taken: %s", why)
        newest = max((m for m in taken if m.signature in served), key=lambda m: m.epoch, default=None)
        last_ended = max((m for m in taken if m.signature not in served), key=lambda m: m.epoch, default=None)
        return (
            newest if newest is not None and newest.epoch >= mine else None,
            plan_from_body(last_ended.epoch, last_ended.plan) if last_ended is not None and last_ended.epoch > mine else None,
            answered,
        )

    # -- the ring protocol's requests about epochs -----------------------------------------------

    async def on_plan(self, peer: str, msg: PlanMsg) -> Message:
        ep = await self.epochs.accept(peer, msg, taken=self.took_plan)
        block = ep.plan.blocks.get(self.peer_id)
        # only a --compile node says how its stage runs: a leader of an older version reads no such field
        ran = self.epochs.models.ran(block) if block is not None and self.settings.compile else None
        return ctl.Loaded(msg.epoch, compiled=ran)

    async def on_current(self, peer: str, msg: ctl.Current) -> Message:
        """What we serve, for a peer catching up (an ended epoch's plan still says who held what)."""
        ep = self.epochs.current
        if ep is not None and ep.live and ep.msg is not None:
            return ep.msg
        if ep is not None and ep.msg is not None:  # as its leader signed it (vouched_plans)
            return ctl.NoPlan(ep.plan.epoch, ep.msg.plan, ep.msg.signer, ep.msg.signature)
        return ctl.NoPlan()

    async def on_ended(self, peer: str, msg: ctl.Ended) -> Message:
        """A member's ring ended and no new plan came: are we behind? Or a hop of our ring broke
        where we cannot see it. Heard at most once per ENDED_EVERY_S per member; only a member of
        the live ring may end it (authority.check_epoch_end), and each end it forces is a strike."""
        n = msg.epoch
        ep = self.epochs.current
        mine = ep.plan.epoch if ep is not None else 0
        check_epoch_step(n, mine, f"ended from {peer}")
        if self.view.leader() != self.peer_id:
            return ctl.Ack()  # not ours to act on
        if not self.benches.strikes.hear(peer, trio.current_time()):
            self.benches.strike(peer, f"ended reports more often than one per {ENDED_EVERY_S:.0f} s")
            raise Forbidden(f"ended from {peer}: at most one per {ENDED_EVERY_S:.0f} s")
        if n == mine and ep is not None and ep.live:
            # a hop of our ring broke where we cannot see it (a relayed connection that
            # DCUtR replaced took its streams along): the ring cannot serve; re-plan
            check_epoch_end(ep.members, peer, n)
            self.epochs.end(f"{peer} reports that epoch {n} ended")
            self.benches.strike(peer, f"its report ended epoch {n}")
            return ctl.Ack()
        if n > mine and self.cut_off_since is None:
            self.notices.notice(f"{peer} served epoch {n}, newer than ours ({mine}): catching up with the swarm")
            self.cut_off_since = float("-inf")  # no settling: the swarm waits on us
            self.view.kick()
        return ctl.Ack()
