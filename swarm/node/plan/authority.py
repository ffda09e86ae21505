"""Who may send what on the ring protocol, and what one party's word is worth.

Theory of operation
-------------------
Admission proves only that a peer holds the swarm secret: a member gone bad, or anyone with a
stolen invite, passes it. So every ring request is also checked against the sender's role in
the plan this node serves (pure functions here; leader.py, recovery.py and epochs.py apply them):

- who may send each request at all is the dispatch table of ``node/dispatch.py`` (a plan only from the
  leader, ``connect`` and ``serve`` only from the current epoch's signer, ``fault`` only from a
  stage of that epoch, ``ended``/``leave``/``leaving``/``current`` only from members; a client
  only generates and reads status). On top of it:
- ``plan`` is taken only when signed by the leader of this node's view (epoch.py); ``connect``
  and ``serve`` only once per epoch (a second one is a no-op, never a second worker or a
  replaced link).
- ``ended`` only from an advertised member, about an epoch at most ``MAX_EPOCH_STEP`` past the
  newest this node knows; a peer catching up adopts a served plan only when it is signed by the
  peer that leads its view without itself (the one that led while it was away), and an ended
  plan only within the same step bound: a forged epoch of 2^62 can no longer wedge the swarm.
- ``fault`` only reaches the leader, only about the current epoch or the one it just replaced
  (the fault may have ended it), and only from the receiving end of the accused's hop: a stage about its upstream, the coordinator about the tail. A claim
  relayed in an ERROR frame (``upstream=<id>``) is no evidence at all; the observing stage
  reports its own upstream directly.

A set-up that fails is a strike only on the leader's own evidence (``setup_blame``): a member
silent to its own ``connect``/``serve`` past CONNECT_REPLY_S, a hop into a member whose
activation door the leader's own probe cannot open either, a hop into the leader; a peer that
says its hop into a neighbour failed strikes nobody (it may be the honest neighbour of a rogue,
or a rogue framing an honest one).

One party's word is a claim, not proof (``FaultClaims``). A peer is excluded from plans on the
leader's own observation or when two different parties accuse it. With a single accuser the
leader cannot tell a faulty sender from a lying receiver, so it benches both ends of the hop
when the rest of the swarm can hold the model without them; when it cannot, or when the
accuser is the coordinator (benching it would fail every generation it holds, and a coordinator
already sees and could spoil every session), it benches the accused alone; but an accuser whose
earlier lone claim was never confirmed is benched instead of its next victim. Framing therefore costs the framer its own place, and in the worst case
(a swarm that cannot spare two peers) one peer per EXCLUDE_S.

What a member says about itself (memory, ms per layer, a draft's ms per token) is signed but
measured by nobody else. Where it decides the coordinator, the role that sees every prompt, it
is bounded first: ``bounded_draft_claims`` (draft speed) and ``bounded_coordinator`` (memory and
ms per layer, held to the leader's own figures or the claims' conservative medians). Layers are
still placed on the claims as made (leader.py, and SECURITY.md "What remains trust among friends").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from swarm.errors import Forbidden, ProtocolError
from swarm.planner import Latency, ModelSpec, Peer, Plan, fits
from swarm.planner import plan as make_plan
from swarm.proto.messages import Plan as PlanMsg
from swarm.proto.signed import verify_plan
from swarm.proto.signing import peer_id_of

MAX_EPOCH_STEP = 10_000  # how far past the newest epoch we know another party's epoch may be
EXCLUDE_S = 300.0  # a benched peer stays out of plans this long (bad activations, strikes)
ENDED_EVERY_S = 3.0  # a member's ``ended`` is heard at most once per this long (an honest one nudges
# once per ended epoch, NUDGE_AFTER_S = 4 s after it ended: recovery.py)
STRIKES = 3  # strikes within EXCLUDE_S that bench a member
# The leader waits this long for a member's answer to its own ``connect`` or ``serve``. An honest
# member answers within LINK_TIMEOUT_S (20 s: wiring.py bounds its whole ``connect``, a hole
# punch's settling included, and ``serve``'s wait for the result link by it) and says so with a
# failure when its hop did not open; the 10 s on top are for a loaded machine whose event loop is
# late (a block still loading in threads, a busy CPU): a member silent past this is not slow, it
# withholds its answer. No answer is a strike (``setup_blame``).
CONNECT_REPLY_S = 30.0
# The leader's own check of a member's activation door after a hop into it failed: a ``probe``
# hello on a fast channel, as every node sends each member once a minute (members/probe.py), and
# its echo. 10 s is 3x the prober's own per-echo bound (3 s) and far past a loaded loopback or LAN.
DOOR_PROBE_S = 10.0


def check_epoch_step(epoch: int, newest_known: int, what: str) -> None:
    """Forbidden if ``epoch`` is implausibly far ahead of what this node has seen."""
    if epoch > newest_known + MAX_EPOCH_STEP:
        raise Forbidden(
            f"{what}: epoch {epoch} is more than {MAX_EPOCH_STEP} past the newest known ({newest_known})"
        )


def vouched_plans(
    shown: Iterable[tuple[str, PlanMsg]], *, leaders: set[str], me: str, swarm_id: str, newest_known: int
) -> tuple[list[PlanMsg], list[str]]:
    """The plans a peer catching up may let decide its next plan, out of ``shown`` ((member,
    signed plan it serves or served last)), and why each other one was refused.

    The invariant (SECURITY.md, issue 27): a plan that can influence another plan is signed by
    the leader that made it and verified before use. Here: signed (an unsigned "previous plan"
    is nobody's word), the signature verifies for this swarm, the signer is one of ``leaders``
    (the peer that led our view while we were away, or we ourselves), the epoch is within
    MAX_EPOCH_STEP of the newest we know, and, unless we signed it, some member other than its
    signer holds it too: a leader's plan reaches every member of its ring, while a plan a member
    signed for itself and showed only us (it grinds an ID to sort just after ours) reaches no one.
    """
    refused: list[str] = []
    ok: dict[bytes, PlanMsg] = {}
    holders: dict[bytes, set[str]] = {}
    for peer, msg in shown:
        try:
            if msg.signer is None or msg.signature is None:
                raise ProtocolError(f"its plan epoch {msg.epoch} is unsigned")
            signer = peer_id_of(msg.signer)
            if signer not in leaders:
                raise Forbidden(f"its plan epoch {msg.epoch} is signed by {signer}, which did not lead here")
            verify_plan(msg, msg.signer, swarm_id)
            check_epoch_step(msg.epoch, newest_known, f"plan shown by {peer}")
        except (ProtocolError, Forbidden) as exc:
            refused.append(f"{peer}: {exc}")
            continue
        ok[msg.signature] = msg
        holders.setdefault(msg.signature, set()).add(peer)
    taken = []
    for sig, msg in ok.items():
        signer = peer_id_of(msg.signer)  # type: ignore[arg-type]
        if signer == me or holders[sig] - {signer}:
            taken.append(msg)
        else:
            refused.append(f"plan epoch {msg.epoch} is held by its signer {signer} alone")
    return taken, refused


def upstreams_of(plan: Plan, peer: str) -> set[str]:
    """The peers whose hops end at ``peer`` in ``plan`` (ring[0]'s upstream is the coordinator,
    the coordinator's is the tail; a coordinator that also holds a stage has both)."""
    out: set[str] = set()
    if peer == plan.coordinator and plan.ring:
        out.add(plan.ring[-1])
    if peer in plan.ring:
        i = plan.ring.index(peer)
        out.add(plan.ring[i - 1] if i > 0 else plan.coordinator)
    out.discard(peer)  # a hop from a node to itself is local: nothing to accuse
    return out


def downstreams_of(plan: Plan, peer: str) -> set[str]:
    """The peers that ``peer``'s hops enter in ``plan`` (the coordinator sends to ring[0], the
    tail to the coordinator); a hop from a node to itself is local and left out."""
    path = [plan.coordinator, *plan.ring, plan.coordinator]
    return {path[i + 1] for i in range(len(path) - 1) if path[i] == peer and path[i + 1] != peer}


def doors_to_probe(plan: Plan, leader: str, answers: dict[str, str]) -> set[str]:
    """Whose activation door the leader checks itself after a failed ``connect``: the far end of
    every hop whose sender answered that it failed, except the leader (its own door is open: it
    is us) and a sender that did not answer at all (that is evidence enough)."""
    out: set[str] = set()
    for peer, answer in answers.items():
        if answer == "failed":
            out |= downstreams_of(plan, peer)
    return out - {leader}


def setup_blame(
    plan: Plan, leader: str, answers: dict[str, str], doors: dict[str, bool], serve: str | None = None
) -> dict[str, str]:
    """Who a failed set-up is a strike against, and why, on the leader's own evidence only.

    ``answers``: each participant's answer to the leader's ``connect``: "linked", "failed" (it
    answered that a hop of its own did not open, or refused), or "silent" (no answer within
    CONNECT_REPLY_S). ``doors``: the leader's own probe of a peer's activation door (True: it
    echoed within DOOR_PROBE_S; see ``doors_to_probe``). ``serve``: the coordinator's answer to
    ``serve`` when that phase ran ("served", "failed", "silent").

    - a participant silent to the leader's own request is struck;
    - a hop that failed into a peer whose door the leader could not open either is the peer's;
    - a sender whose only hop enters the leader and that failed is struck (the leader takes hops:
      it is us);
    - a coordinator that is the leader and never got its result link, after the tail answered
      that it had opened it, was told a lie by the tail;
    - a sender accusing a neighbour whose door answers the leader strikes nobody: the leader
      cannot tell a lying sender from a withholding receiver, and a rogue must not be able to
      frame its honest neighbour (nor the neighbour its sender).
    """
    out: dict[str, str] = {}
    for peer, answer in sorted(answers.items()):
        if peer == leader:
            continue
        if answer == "silent":
            out[peer] = f"it did not answer the leader's connect of epoch {plan.epoch} within {CONNECT_REPLY_S:.0f} s"
    for peer, answer in sorted(answers.items()):
        if answer != "failed":
            continue
        dsts = downstreams_of(plan, peer)
        if dsts == {leader} and peer != leader:  # its only hop enters the leader, which takes hops
            out.setdefault(peer, f"its hop into the leader in epoch {plan.epoch} did not open (the leader takes hops)")
        for dst in sorted(dsts):
            if dst != leader and doors.get(dst) is False:
                out.setdefault(
                    dst, f"a hop into it failed in epoch {plan.epoch} and the leader could not open its door either"
                )
    coord, tail = plan.coordinator, plan.ring[-1] if plan.ring else plan.coordinator
    if serve == "silent" and coord != leader:
        out.setdefault(coord, f"it did not answer the leader's serve of epoch {plan.epoch} within {CONNECT_REPLY_S:.0f} s")
    if serve == "failed" and coord == leader and tail != leader and answers.get(tail) == "linked":
        out.setdefault(tail, f"it answered that its hop into the leader was open in epoch {plan.epoch}; none arrived")
    return out


def check_fault_report(plan: Plan, accuser: str, accused: str, epoch: int) -> None:
    """Forbidden unless ``accuser`` may report ``accused`` in ``plan`` (its own inbound hop)."""
    if epoch != plan.epoch:
        raise Forbidden(f"fault report from {accuser} about epoch {epoch}; epoch {plan.epoch} is current")
    ups = upstreams_of(plan, accuser)
    if accused not in ups:
        raise Forbidden(
            f"fault report from {accuser} about {accused}: a peer may report only its own upstream "
            f"hop in epoch {plan.epoch} ({', '.join(sorted(ups)) or 'none'})"
        )


def bounded_draft_claims(peers: list[Peer], me: str) -> list[Peer]:
    """``peers`` with every other member's claimed draft speed bounded before it can decide the
    coordinator (the role that sees every prompt): nobody else is believed to draft faster than
    we measured our own draft model, or, when we run none, faster than the (upper) median of the
    claims. A member advertising a 0.01 ms/token draft no longer outbids honest ones; honest
    members that claim alike keep what they claim. Our own figure is measured (drafting.py). Not
    bounded: a lone claim when we run no draft (there is nothing to compare it with)."""
    claims = sorted(p.draft_ms for p in peers if p.draft_ms is not None)
    if not claims:
        return peers
    own = next((p.draft_ms for p in peers if p.id == me and p.draft_ms is not None), None)
    floor = own if own is not None else claims[len(claims) // 2]  # the upper median (of one: itself)
    return [
        dataclasses.replace(p, draft_ms=max(p.draft_ms, floor)) if p.id != me and p.draft_ms is not None else p
        for p in peers
    ]


def role_bounds(peers: list[Peer], me: str) -> tuple[float, int]:
    """(floor on ms per layer, cap on memory) that other members' claims are held to when they
    decide the coordinator (:func:`bounded_role_claims`).

    Our own figures are evidence: we measured our ms per layer (runtime.measure_ms_per_layer) and
    we know what we offer. So nobody else is believed to be faster per layer than we measured
    ourselves, nor to hold more than we offer; when we have no figure of our own (we hold no
    layers, or measured nothing), the conservative median of the claims of the members that offer
    memory stands in: the upper median of the ms per layer (the slower side) and the lower median
    of the memory (the smaller side). A member that over-claims moves neither our figures nor, while
    over-claimers are fewer than half, a median."""
    hosts = [p for p in peers if p.memory_bytes > 0]
    own = next((p for p in peers if p.id == me), None)
    speeds = sorted(p.ms_per_layer for p in hosts)
    mems = sorted(p.memory_bytes for p in hosts)
    if own is not None and own.ms_per_layer > 0:
        floor = own.ms_per_layer
    else:
        floor = speeds[len(speeds) // 2] if speeds else 0.0
    if own is not None and own.memory_bytes > 0:
        cap = own.memory_bytes
    else:
        cap = mems[(len(mems) - 1) // 2] if mems else 0
    return floor, cap


def bounded_role_claims(peers: list[Peer], me: str, *, memory_cap: int | None = None) -> list[Peer]:
    """``peers`` as the coordinator is chosen from them: every other member's claimed ms per layer
    floored and its claimed memory capped at :func:`role_bounds` (``memory_cap`` overrides the
    cap: :func:`bounded_coordinator` raises it when the model needs a larger claim believed). A
    member claiming 0.001 ms per layer and 10 TB looks like one that claims what we measured
    ourselves; members that claim no better than that keep what they claim. Our own figures are
    kept as they are."""
    floor, cap = role_bounds(peers, me)
    if memory_cap is not None:
        cap = memory_cap
    return [
        p if p.id == me else dataclasses.replace(p, ms_per_layer=max(p.ms_per_layer, floor),
                                                 memory_bytes=min(p.memory_bytes, cap))
        for p in peers
    ]  # fmt: skip


def bounded_coordinator(
    spec: ModelSpec, peers: list[Peer], latency: Latency, me: str, *, previous: Plan | None, epoch: int
) -> str:
    """The coordinator the planner chooses when the other members' claims about themselves
    (signed, but measured by nobody else) are bounded (:func:`bounded_role_claims`): the
    coordinator sees every prompt, so an absurd claim must not attract it. When the bounded
    members' memory cannot hold the model, the memory cap is raised to the smallest larger claim
    with which it can (a claim is believed as far as the model needs it, no further); never for
    want of an RTT. PlanningError (the planner's) when no plan can be made yet.

    Only the coordinator is chosen this way: the caller then places the layers on the claims as
    made, with the coordinator pinned to this choice (leader.py). Honest swarms mix a 4090 with a
    laptop, claims ten times apart, and layers placed as if every member were the median one
    would run slower on every token; a member that over-claims its way to more layers sees
    hidden states, not prompts. The price in an honest swarm: a member faster than the
    leader measured itself no longer draws the coordinator for its speed alone (it still gets
    the layers its speed earns; the coordinator may then sit one hop away from them)."""
    _, cap = role_bounds(peers, me)

    def bounded(c: int) -> list[Peer]:
        return bounded_role_claims(peers, me, memory_cap=c)

    caps = [cap, *sorted({p.memory_bytes for p in peers if p.id != me and p.memory_bytes > cap})]
    if not fits(spec, bounded(caps[0])):
        # memory, not reachability, is short: find the smallest cap that holds the model (a
        # larger cap only adds memory; the largest is the claims as made, and the planner's
        # message then says what is missing). An RTT not measured yet never raises the cap: a
        # rogue that claims to hold everything alone needs no edge, and would win every wait.
        lo, hi = 0, len(caps) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(spec, bounded(caps[mid])) else (mid, hi)
        cap = caps[hi]
    return make_plan(spec, bounded(cap), latency, previous=previous, epoch=epoch).coordinator


def check_epoch_end(ring: set[str], sender: str, epoch: int) -> None:
    """Forbidden unless ``sender`` may end epoch ``epoch`` by telling the leader that it ended:
    only a member of that ring (the coordinator or a stage) knows that a hop of its own broke."""
    if sender not in ring:
        raise Forbidden(f"ended from {sender} about epoch {epoch}: only a member of that ring may end it")


@dataclass
class Strikes:
    """What the leader holds against each member: when its last ``ended`` was heard (one per
    ``every`` seconds) and its strikes (an ``ended`` past that rate, an epoch end it forced, a
    set-up it failed on the leader's own evidence: ``setup_blame``), each kept ``window`` seconds; ``limit`` strikes bench it, by the same
    bench as bad activations. Pure: ``now`` is an input; bounded whatever members send."""

    window: float = EXCLUDE_S
    every: float = ENDED_EVERY_S
    limit: int = STRIKES
    max_entries: int = 256
    _heard: dict[str, float] = field(default_factory=dict)  # member -> time its last ended was heard
    _strikes: dict[str, list[float]] = field(default_factory=dict)

    def hear(self, peer: str, now: float) -> bool:
        """True if ``peer``'s ``ended`` may be heard now (and it is then counted); False: too soon."""
        last = self._heard.get(peer)
        if last is not None and now - last < self.every:
            return False
        self._heard[peer] = now
        if len(self._heard) > self.max_entries:
            self._heard = {p: t for p, t in self._heard.items() if now - t < self.every}
        return True

    def strike(self, peer: str, now: float) -> int:
        """Count one strike against ``peer``; how many it has within the window."""
        kept = [t for t in self._strikes.get(peer, []) if now - t < self.window][-self.limit :]
        kept.append(now)
        self._strikes[peer] = kept
        if len(self._strikes) > self.max_entries:
            del self._strikes[min(self._strikes, key=lambda p: self._strikes[p][-1])]
        return len(kept)

    def forgive(self, peer: str) -> None:
        """``peer`` was benched: its strikes are spent."""
        self._strikes.pop(peer, None)


@dataclass
class ByteReports:
    """Reports that a member served model bytes failing the manifest's sha256 (issue 25). The
    leader cannot check one (the bytes are not signed by their sender), so one member's reports
    about another count once per ``window``, however many it sends: a lone member cannot bench
    anyone with them; STRIKES from several members (or with other strikes) do. Pure."""

    window: float
    max_entries: int = 256
    _heard: dict[tuple[str, str], float] = field(default_factory=dict)

    def hear(self, accuser: str, accused: str, now: float) -> bool:
        """True if this report counts (a strike against ``accused``); False: heard already."""
        last = self._heard.get((accuser, accused))
        if last is not None and now - last < self.window:
            return False
        self._heard[(accuser, accused)] = now
        if len(self._heard) > self.max_entries:
            self._heard = {k: t for k, t in self._heard.items() if now - t < self.window}
            while len(self._heard) > self.max_entries:
                del self._heard[min(self._heard, key=lambda k: self._heard[k])]
        return True


@dataclass
class Verdict:
    """What the leader does with a fault report: peers to bench, and why in words."""

    bench: list[str]
    why: str


@dataclass
class FaultClaims:
    """Accusations the leader has heard, each kept ``window`` seconds. Pure: ``now`` is an input."""

    window: float
    _claims: dict[str, dict[str, float]] = field(default_factory=dict)  # accused -> accuser -> time
    _lone: dict[str, tuple[str, float]] = field(default_factory=dict)  # accuser -> (accused, time)
    max_entries: int = 256

    def _prune(self, now: float) -> None:
        for accused in list(self._claims):
            kept = {a: t for a, t in self._claims[accused].items() if now - t < self.window}
            if kept:
                self._claims[accused] = kept
            else:
                del self._claims[accused]
        self._lone = {a: v for a, v in self._lone.items() if now - v[1] < self.window}

    def report(self, accuser: str, accused: str, *, leader: str, now: float, spare_both: bool) -> Verdict:
        """Record ``accuser``'s claim against ``accused``. ``spare_both``: the swarm can hold the
        model without both of them, and the accuser may be benched (it is not the coordinator)."""
        self._prune(now)
        if accuser == leader:
            return Verdict([accused], f"observed by the leader {accuser}")
        by = self._claims.setdefault(accused, {})
        by[accuser] = now
        if len(self._claims) > self.max_entries:  # bounded whatever members send
            del self._claims[min(self._claims, key=lambda k: max(self._claims[k].values()))]
        others = sorted(a for a in by if a != accuser)
        if others:
            for a in [accuser, *others]:
                self._lone.pop(a, None)
            return Verdict([accused], f"reported by {accuser} and {', '.join(others)}")
        prior = self._lone.get(accuser)
        if prior is not None and prior[0] != accused:
            return Verdict(
                [accuser], f"{accuser} accused {prior[0]} and now {accused}, neither confirmed by anyone else"
            )
        self._lone[accuser] = (accused, now)
        if spare_both:
            return Verdict(
                [accused, accuser],
                f"{accuser} alone reports {accused}; the hop between them is benched, both ends",
            )
        return Verdict([accused], f"{accuser} alone reports {accused} (the swarm cannot spare both)")
