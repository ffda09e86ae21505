"""When the ring loses a peer: losses, stalls, faults, leaving on purpose, and nudging a leader.

Theory of operation
-------------------
A ring member that is lost (membership declares it, or it closes its connection) ends the epoch
at every peer that sees it; the leader then plans the next one from the survivors (leader.py)
and the coordinator's generations resume on it (resume.py). A member whose ring ended and that
sees no new plan within NUDGE_AFTER_S tells the leader which epoch ended (``ended``): a leader
whose own view is stale then catches up instead of the swarm waiting on it forever. A node that
finds it was stopped (its heartbeat clock jumped) or sees every other member go marks its view
cut off: it catches up before it plans again.

Bad activations are reported by the receiving end of the hop to the leader, which weighs the
claim (authority.py) and benches peers for EXCLUDE_S. Leaving on purpose is bounded: every member
hears ``leaving`` first (so a leaving leader hands leadership over), then the leader re-plans
without the leaver and answers once that ring serves (``leave``), within LEAVE_TIMEOUT_S.
"""

from __future__ import annotations

import logging

import trio

from swarm.errors import PeerError, PeerTimeout, PlanningError, ProtocolError, SwarmError
from swarm.node.dispatch import RPC_TIMEOUT_S, RingClient
from swarm.node.members.gossip import MemberEvent
from swarm.node.members.view import MemberView
from swarm.node.notices import Notices
from swarm.node.plan.authority import EXCLUDE_S, ByteReports, FaultClaims, check_fault_report
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.plan.leader import Leader
from swarm.proto import control as ctl
from swarm.proto.messages import Message
from swarm.proto.text import printable

log = logging.getLogger("swarm.node")

LEAVE_TIMEOUT_S = 5.0  # a leaver waits at most this long for its hand-over, then goes anyway
LEAVING_NOTICE_S = 1.5  # ... of which telling the members it leaves takes at most this long
NUDGE_AFTER_S = 4.0  # a member whose ring ended tells the leader after this long without a new plan


class Recovery:
    """``ended``: each epoch that ended here, as the epochs' ``on_end`` sent it (serving.py
    opens the channel; :meth:`run` reads it)."""

    def __init__(
        self, view: MemberView, epochs: Epochs, leader: Leader, ring: RingClient, notices: Notices,
        nursery: trio.Nursery, *, ended: trio.MemoryReceiveChannel[Epoch] | None = None,
    ) -> None:  # fmt: skip
        self.peer_id = view.peer_id
        self.ended = ended
        self.view = view
        self.epochs = epochs
        self.leader = leader
        self.ring = ring
        self.notices = notices
        self.nursery = nursery
        self.claims = FaultClaims(window=EXCLUDE_S)  # fault reports heard (authority.py)
        self.byte_reports = ByteReports(window=EXCLUDE_S)  # bad model bytes reports heard (authority.py)

    # -- losses ----------------------------------------------------------------------------

    def member_event(self, ev: MemberEvent) -> None:
        """Membership news: wake the leader; a lost ring member ends the epoch."""
        self.view.kick()
        if ev.kind not in ("left", "lost"):
            return
        self.view.leaving.discard(ev.peer)  # gone: if it comes back (same key, restarted), it is a member again
        if self.view.members() == [self.peer_id] and self.leader.cut_off_since is None:
            self.leader.cut_off()  # everyone else went: they may go on without us
        ep = self.epochs.current
        if ep is not None and ev.peer in ep.members:
            self.epochs.end(f"ring member {ev.peer} {ev.kind}" + (f" ({ev.reason})" if ev.reason else ""))

    def stalled(self, gap: float) -> None:
        """This node was stopped for ``gap`` seconds (its own silence is excused: heartbeat.py)."""
        self.notices.notice(f"this node was stopped for {gap:.1f} s: it catches up with the swarm before it plans")
        self.leader.cut_off()

    async def run(self) -> None:
        """Each epoch that ended (``ended``): :meth:`epoch_ended`."""
        assert self.ended is not None
        async for ep in self.ended:
            self.epoch_ended(ep)

    def epoch_ended(self, ep: Epoch) -> None:
        self.view.kick()
        try:
            leading = self.view.leader() == self.peer_id
        except (AssertionError, IndexError):  # a node not running yet has no leader
            return
        if not leading:
            self.nursery.start_soon(self._nudge_leader, ep)  # if no new plan comes, say so

    async def _nudge_leader(self, ended: Epoch) -> None:
        """A ring we served ended; if no new plan comes within NUDGE_AFTER_S, tell the leader
        which epoch ended: one whose own view is stale (it was cut off and missed that epoch)
        then knows to catch up, instead of the swarm waiting on it forever."""
        await trio.sleep(NUDGE_AFTER_S)
        if self.epochs.current is not ended or self.view.leader() == self.peer_id:
            return
        try:
            with trio.fail_after(RPC_TIMEOUT_S):
                await self.ring.call(self.view.leader(), ctl.Ended(ended.plan.epoch))
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("could not tell the leader that epoch %d ended: %s", ended.plan.epoch, exc)

    # -- faults ----------------------------------------------------------------------------

    async def report_fault(self, peer: str, reason: str, epoch: int) -> None:
        """Tell the leader that ``peer``, our upstream in ``epoch``, sent bad activations
        (bounded; best effort). See authority.py for what the leader makes of it."""
        self.notices.notice(f"peer {peer} sent bad activations: reporting it to the leader ({printable(reason)[:200]})")
        try:
            if self.view.leader() == self.peer_id:
                self.fault_report(self.peer_id, peer, epoch, reason)
                return
            with trio.fail_after(RPC_TIMEOUT_S):
                reply = await self.ring.call(self.view.leader(), ctl.Fault(peer, epoch, reason[:900]))
            if isinstance(reply, ctl.Fail):
                log.warning("the leader refused our report about %s: %s", peer, printable(reply.message))
        except (SwarmError, trio.TooSlowError) as exc:
            log.warning("could not report %s to the leader: %s", peer, exc)

    def fault_report(self, accuser: str, accused: str, epoch: int, reason: str) -> None:
        """Leader: weigh a report that ``accused`` sent ``accuser`` bad activations."""
        if self.view.leader() != self.peer_id:
            raise ProtocolError(f"{self.peer_id} is not the leader; ask {self.view.leader()}")
        ep = self.epochs.known(epoch)  # the current epoch, or the one that just ended with the fault
        if ep is None:
            raise ProtocolError(f"fault report about epoch {epoch}: neither the current epoch here nor the last")
        check_fault_report(ep.plan, accuser, accused, epoch)
        spare_both = accuser != ep.plan.coordinator  # benching it would fail every session it holds
        if spare_both:
            try:
                self.leader.plan_for([p for p in self.view.plannable() if p not in {accused, accuser}], ep.plan, 0)
            except PlanningError:
                spare_both = False
        verdict = self.claims.report(accuser, accused, leader=self.peer_id, now=trio.current_time(), spare_both=spare_both)
        why = f"{verdict.why}: {printable(reason)[:300]}"
        for p in verdict.bench:
            self._exclude(p, why)

    async def report_bad_bytes(self, peer: str, reason: str) -> None:
        """Tell the leader that member ``peer`` served us model bytes that fail their hash
        (bounded; best effort)."""
        try:
            if self.view.leader() == self.peer_id:
                self.bad_bytes_report(self.peer_id, peer, reason)
                return
            with trio.fail_after(RPC_TIMEOUT_S):
                reply = await self.ring.call(self.view.leader(), ctl.BadBytes(peer, reason[:900]))
            if isinstance(reply, ctl.Fail):
                log.warning("the leader refused our report about %s: %s", peer, printable(reply.message))
        except (SwarmError, trio.TooSlowError) as exc:
            log.warning("could not report %s to the leader: %s", peer, exc)

    def bad_bytes_report(self, accuser: str, accused: str, reason: str) -> None:
        """Leader: weigh a report that ``accused`` served ``accuser`` model bytes failing their
        hash. Seen by the leader itself: benched at once; from another member: one strike per
        accuser and window (authority.ByteReports)."""
        if self.view.leader() != self.peer_id:
            raise ProtocolError(f"{self.peer_id} is not the leader; ask {self.view.leader()}")
        if accused in (accuser, self.peer_id):
            return  # nobody accuses itself; the leader does not bench itself on a member's word
        why = f"served {accuser} model bytes that fail the manifest's sha256: {printable(reason)[:300]}"
        if accuser == self.peer_id:
            self._exclude(accused, why)
        elif self.byte_reports.hear(accuser, accused, trio.current_time()):
            self.leader.benches.strike(accused, why)

    async def on_bad_bytes(self, peer: str, msg: ctl.BadBytes) -> Message:
        self.bad_bytes_report(peer, msg.peer, msg.reason)
        return ctl.Ack()

    def _exclude(self, peer: str, reason: str) -> None:
        self.leader.benches.bench(peer, reason)

    async def on_fault(self, peer: str, msg: ctl.Fault) -> Message:
        self.fault_report(peer, msg.peer, msg.epoch, msg.reason)
        return ctl.Ack()

    # -- leaving on purpose ------------------------------------------------------------------

    async def leave(self, timeout: float = LEAVE_TIMEOUT_S) -> None:
        """Leave on purpose, within ``timeout`` whatever the others do.

        Every member first hears that we leave (``leaving``): none plans with us or takes a plan
        from us from then on, so a leaving leader hands leadership to the next smallest ID. If we
        hold part of the serving ring, the (new) leader is asked to re-plan without us (``leave``)
        and we wait until its new epoch is set up, so the generations in flight move to it (a
        short pause) instead of failing when we go. Bounded: after ``timeout`` we go anyway, and
        the swarm treats us as lost (it re-plans; generations resume by replay)."""
        others = [p for p in self.view.members() if p != self.peer_id]
        self.view.leaving.add(self.peer_id)
        self.view.kick()
        ep = self.epochs.serving
        in_ring = ep is not None and self.peer_id in ep.members
        self.notices.life("leaving", in_ring=in_ring, members=len(others))
        if not others:
            self.notices.life("handover", result="alone: nobody to hand over to")
            return
        deadline = trio.current_time() + timeout
        with trio.move_on_after(min(timeout, LEAVING_NOTICE_S)):
            async with trio.open_nursery() as nursery:
                for p in others:
                    nursery.start_soon(self._tell_leaving, p)
        if not in_ring:
            self.notices.life("handover", result="not in the ring: nothing to hand over")
            return
        leader = self.view.leader()
        if leader == self.peer_id:
            self.notices.life("handover", result="every member is leaving")
            return
        self.notices.notice(f"leaving: asking the leader {leader[:16]}… to re-plan without this node")
        try:
            with trio.fail_after(max(0.1, deadline - trio.current_time())):
                reply = await self.ring.call(leader, ctl.Leave(), timeout)
            if isinstance(reply, ctl.Fail):
                raise reply.error("the leader refused our leave: ")
            ctl.expect(reply, ctl.Ack, leader, "leave")
            self.notices.life("handover", result="done", leader=leader)
        except trio.TooSlowError:
            self.notices.notice(f"leaving without a hand-over (no new ring within {timeout:.0f} s)")
            self.notices.life("handover", result=f"timed out after {timeout:.0f} s", leader=leader)
        except SwarmError as exc:
            self.notices.notice(f"leaving without a hand-over ({exc})")
            self.notices.life("handover", result=f"failed: {exc}", leader=leader)

    async def _tell_leaving(self, peer: str) -> None:
        try:
            await self.ring.call(peer, ctl.Leaving(), LEAVING_NOTICE_S)
        except SwarmError as exc:
            log.info("could not tell %s that we leave: %s", peer, exc)

    async def on_leaving(self, peer: str, msg: ctl.Leaving) -> Message:
        """``peer`` leaves: never plan with it, nor take its plans."""
        self.view.leaving.add(peer)
        self.view.kick()
        return ctl.Ack()

    async def on_leave(self, peer: str, msg: ctl.Leave) -> Message:
        """Leader: re-plan without ``peer``; answer once an epoch without it is set up here
        (bounded by LEAVE_TIMEOUT_S: the leaver does not wait longer either)."""
        self.view.leaving.add(peer)
        if self.peer_id in self.view.leaving:
            raise PeerError(f"{self.peer_id} is leaving too")
        if self.view.leader() != self.peer_id:
            raise ProtocolError(f"{self.peer_id} is not the leader; ask {self.view.leader()}")
        problem = self.leader.planning_problem()
        if problem is not None:  # the others cannot hold the model without it: no hand-over to wait for
            self.view.leaving.discard(peer)
            raise PlanningError(f"the swarm cannot re-plan without {peer}: {problem}")
        ep = self.epochs.current
        if ep is not None and peer in ep.members:
            self.epochs.end(f"peer {peer} is leaving")
        def without() -> Epoch | None:
            ep = self.epochs.serving
            return ep if ep is not None and peer not in ep.members else None

        if await self.epochs.wait_for(without, LEAVE_TIMEOUT_S) is not None:
            return ctl.Ack()
        raise PeerTimeout(f"no ring without {peer} within {LEAVE_TIMEOUT_S:.0f} s")

