"""Failure detector: heartbeats in, alive -> suspect -> lost transitions out. Pure; time is an input.

Theory of operation
-------------------
Every frame heard from a peer (heartbeat, pong, advert) is evidence that it is alive; the
detector only remembers *when* it last heard from each peer. ``tick(now)`` compares that with the
clock: silent for ``suspect_after`` seconds -> SUSPECT, for ``lost_after`` seconds -> LOST. A
killed peer usually announces itself sooner (its connection closes with EOF):
``declare_lost`` handles that at once. Nothing here sleeps or reads a clock: callers pass ``now``
(trio.current_time() in production, a MockClock in tests), so "lost at t = 2.5 s after the
last beat" is a deterministic statement.

Defaults (beats every 0.5 s from :mod:`swarm.node.members.heartbeat`): a frozen or killed peer is lost
2.5 s after its last beat, i.e. within ~3 s; a slow but live peer that still beats at least once
per ``suspect_after`` is never even suspected, and a suspect peer that speaks again is ALIVE again.

Incarnations: a LOST peer that is heard from again does not resurrect its old membership. It
rejoins as a new member with ``incarnation + 1`` (a REJOINED transition), so everything that held
state for the old incarnation (ring stages, KV caches) knows that state is gone.

Slow is not gone, and re-plans are rate-limited per peer. A peer declared lost for its silence
that is heard again was slow (a held event loop, a swapping box), not gone: each such return
doubles the silence it is allowed before it is declared lost again (its *patience*, up to
MAX_PATIENCE times the defaults), and the patience halves again after each PATIENCE_DECAY_S it
stays alive. So a peer whose load makes it miss heartbeats cannot make the swarm re-plan at the
rate of the heartbeats: the n-th re-plan it causes within a few minutes needs 2^n times the
silence. The LOST transition's reason says so (it reaches the user's notice). A peer whose
connection closes (``declare_lost``: killed, left) is gone at once, whatever its patience.

Invariants: ``suspect_after < lost_after``; a peer's incarnation never decreases; its patience
is between 1 and MAX_PATIENCE; each call returns the transitions it caused, in order, and only
those.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from swarm.errors import UsageError

DEFAULT_SUSPECT_AFTER = 1.25
DEFAULT_LOST_AFTER = 2.5
MAX_PATIENCE = 8.0  # a flapping peer is at most allowed 8x the silence (20 s by default)
PATIENCE_DECAY_S = 60.0  # ... and its patience halves after each minute it stays alive


class PeerState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    LOST = "lost"


@dataclass(frozen=True)
class Transition:
    """One change of a peer's state, at time ``at`` (seconds on the caller's clock)."""

    peer: str
    old: PeerState | None  # None: first time we hear of this peer
    new: PeerState
    incarnation: int
    at: float
    reason: str = ""

    @property
    def rejoined(self) -> bool:
        return self.old is PeerState.LOST and self.new is PeerState.ALIVE


@dataclass
class _Record:
    state: PeerState
    last_heard: float
    incarnation: int
    reason: str = ""
    patience: float = 1.0  # multiplies suspect_after and lost_after for this peer
    patience_since: float = 0.0  # when the patience last changed
    lost_silent: bool = False  # its last loss was for silence (not a closed connection)


class FailureDetector:
    """Tracks liveness of peers from the times we hear from them.

    ``heard(peer, now)`` on every frame from ``peer``; ``tick(now)`` periodically (every heartbeat
    interval is plenty); ``declare_lost(peer, now, reason)`` when the transport says the peer is
    gone (EOF, reset). All return the list of :class:`Transition` they caused.
    """

    def __init__(
        self,
        *,
        suspect_after: float = DEFAULT_SUSPECT_AFTER,
        lost_after: float = DEFAULT_LOST_AFTER,
    ) -> None:
        if not 0 < suspect_after < lost_after:
            raise UsageError(
                f"failure detector: need 0 < suspect_after ({suspect_after}) < lost_after ({lost_after})"
            )
        self.suspect_after = suspect_after
        self.lost_after = lost_after
        self._peers: dict[str, _Record] = {}

    # -- inputs ------------------------------------------------------------------------------

    def heard(self, peer: str, now: float) -> list[Transition]:
        rec = self._peers.get(peer)
        if rec is None:
            self._peers[peer] = _Record(PeerState.ALIVE, now, 0)
            return [Transition(peer, None, PeerState.ALIVE, 0, now, "first heard")]
        if now < rec.last_heard:  # out-of-order report: it tells us nothing new
            return []
        rec.last_heard = now
        if rec.state is PeerState.ALIVE:
            return []
        old = rec.state
        if old is PeerState.LOST:
            rec.incarnation += 1
            reason = "heard again after being lost: new incarnation"
            if rec.lost_silent:  # it was slow, not gone: be more patient with it next time
                rec.patience = min(MAX_PATIENCE, rec.patience * 2)
                rec.patience_since = now
                reason += f"; it was slow, not gone: it is now allowed {self.lost_after * rec.patience:.1f} s of silence"
        else:
            reason = "heard again"
        rec.state, rec.reason = PeerState.ALIVE, reason
        return [Transition(peer, old, PeerState.ALIVE, rec.incarnation, now, reason)]

    def tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        for peer, rec in self._peers.items():
            if rec.state is PeerState.LOST:
                continue
            if rec.patience > 1 and now - rec.patience_since >= PATIENCE_DECAY_S:
                rec.patience, rec.patience_since = max(1.0, rec.patience / 2), now
            silent = now - rec.last_heard
            if silent >= self.lost_after * rec.patience:
                nxt = self.lost_after * min(MAX_PATIENCE, rec.patience * 2)
                why = (
                    f"silent for {silent:.2f} s (allowed {self.lost_after * rec.patience:.1f} s); if it comes back "
                    f"it is allowed {nxt:.1f} s before it is lost again (re-plans are rate-limited per peer)"
                )
                out.append(self._set(peer, rec, PeerState.LOST, now, why))
                rec.lost_silent = True
            elif silent >= self.suspect_after * rec.patience and rec.state is PeerState.ALIVE:
                out.append(self._set(peer, rec, PeerState.SUSPECT, now, f"silent for {silent:.2f} s"))
        return out

    def declare_lost(self, peer: str, now: float, reason: str) -> list[Transition]:
        rec = self._peers.get(peer)
        if rec is None or rec.state is PeerState.LOST:
            return []
        rec.lost_silent = False
        return [self._set(peer, rec, PeerState.LOST, now, reason)]

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def excuse_silence(self, now: float) -> None:
        """We were stopped ourselves (a stall of our own clock's loop): what we did not hear
        meanwhile says nothing about the others, so every live peer's silence restarts now."""
        for rec in self._peers.values():
            if rec.state is not PeerState.LOST:
                rec.last_heard = max(rec.last_heard, now)

    # -- queries -----------------------------------------------------------------------------

    def state(self, peer: str) -> PeerState | None:
        rec = self._peers.get(peer)
        return None if rec is None else rec.state

    def incarnation(self, peer: str) -> int:
        rec = self._peers.get(peer)
        return 0 if rec is None else rec.incarnation

    def patience(self, peer: str) -> float:
        """How many times the default silence ``peer`` is allowed before it is declared lost."""
        rec = self._peers.get(peer)
        return 1.0 if rec is None else rec.patience

    def last_heard(self, peer: str) -> float | None:
        rec = self._peers.get(peer)
        return None if rec is None else rec.last_heard

    def live_peers(self) -> list[str]:
        """Peers not declared lost (alive or suspect), sorted."""
        return sorted(p for p, r in self._peers.items() if r.state is not PeerState.LOST)

    def next_deadline(self, now: float) -> float | None:
        """The earliest time at which ``tick`` could change something (None: nothing pending)."""
        times: list[float] = []
        for rec in self._peers.values():
            if rec.state is PeerState.ALIVE:
                times.append(rec.last_heard + self.suspect_after * rec.patience)
            elif rec.state is PeerState.SUSPECT:
                times.append(rec.last_heard + self.lost_after * rec.patience)
        return max(now, min(times)) if times else None

    def _set(self, peer: str, rec: _Record, new: PeerState, now: float, reason: str) -> Transition:
        old, rec.state, rec.reason = rec.state, new, reason
        return Transition(peer, old, new, rec.incarnation, now, reason)
