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

One party's word is a claim, not proof (``FaultClaims``). A peer is excluded from plans on the
leader's own observation or when two different parties accuse it. With a single accuser the
leader cannot tell a faulty sender from a lying receiver, so it benches both ends of the hop
when the rest of the swarm can hold the model without them; when it cannot, or when the
accuser is the coordinator (benching it would fail every generation it holds, and a coordinator
already sees and could spoil every session), it benches the accused alone; but an accuser whose
earlier lone claim was never confirmed is benched instead of its next victim. Framing therefore costs the framer its own place, and in the worst case
(a swarm that cannot spare two peers) one peer per EXCLUDE_S.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.errors import Forbidden
from swarm.planner import Plan

MAX_EPOCH_STEP = 10_000  # how far past the newest epoch we know another party's epoch may be


def check_epoch_step(epoch: int, newest_known: int, what: str) -> None:
    """Forbidden if ``epoch`` is implausibly far ahead of what this node has seen."""
    if epoch > newest_known + MAX_EPOCH_STEP:
        raise Forbidden(
            f"{what}: epoch {epoch} is more than {MAX_EPOCH_STEP} past the newest known ({newest_known})"
        )


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
