"""A generation outlives its ring: when the ring fails, the run waits for the next epoch and
resumes on it, token for token.

Theory of operation
-------------------
The coordinator keeps the run (decoder, committed tokens, the log of fed chunks); the swarm
re-plans around the lost peer (the leader's job, leader.py); the run then resumes on the new ring
by replaying its fed chunks (coordinator.drive), so no token is lost or changed. The client hears,
in one line, that the run paused and why, every NOTICE_EVERY_S while it waits (so a client, or a
relaying peer, never mistakes the pause for silence), and when it resumes. A run gives up when
no serving epoch comes within RECOVERY_TIMEOUT_S, or sooner when the planner says the live
members cannot hold the model (its words: how many GB are missing) for PROBLEM_GRACE_S. When
the next epoch is coordinated elsewhere (two halves of a partition met, and the merged ring's
coordinator is the other half's; or the leader had to move the coordinator), :class:`CoordinatorMoved`
says where: the generation service hands the rest of the run to that coordinator, which goes on
from the prompt plus the tokens committed here (service.py), so the run finishes, not fails.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarm.errors import FaultyPeer, PeerError, PlanningError
from swarm.node.notices import Notices
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.ring.coordinator import RingRun

RECOVERY_TIMEOUT_S = 120.0  # a re-plan may include loading a block
NOTICE_EVERY_S = 2.0  # while a run waits for a re-plan, its client hears this often that it does
PROBLEM_GRACE_S = 3.0  # how long the planner may call the swarm too small before a run gives up


class CoordinatorMoved(PeerError):
    """The run's next ring is coordinated by ``coordinator`` (epoch ``epoch``), not by us;
    ``ran``: how the ring it left ran its stages (the receipt's replay note)."""

    def __init__(self, message: str, coordinator: str, epoch: Epoch, failed_at: float,
                 ran: dict[str, dict[str, Any]] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.coordinator, self.epoch, self.failed_at = coordinator, epoch, failed_at
        self.ran = ran or {}


@dataclass
class Resumer:
    """What a run needs to survive its ring: the epochs, the leader's planning problem, and the
    leader to report a faulty peer to."""

    peer_id: str
    epochs: Epochs
    notices: Notices
    planning_problem: Callable[[], str | None]
    report_fault: Callable[[str, str, int], Awaitable[None]]

    async def drive(
        self, ep: Epoch, run: RingRun, replans: list[dict[str, Any]], last_token: list[float],
        notify: Callable[[str], None] = lambda text: None,
    ) -> Epoch:  # fmt: skip
        """Drive ``run`` to the end, moving it to the next epoch's ring whenever its ring fails;
        the epoch it finished on."""
        while True:
            assert ep.coordinator is not None
            try:
                await ep.coordinator.drive(run)
                return ep
            except PeerError as exc:  # the ring failed (lost, timed out, an error from a stage)
                failed_at = time.time()
                old, ran = ep.plan, dict(ep.compiled)  # how its stages ran (the receipt's replay note)
                # Whatever broke (a lost peer, a hop gone silent, a stage's error), this ring cannot
                # carry the run: end its epoch here. A loss already ended it; a ring that stalls with
                # every peer alive (a relayed stream that died silently) ends only here, and ending
                # it nudges the leader to re-plan (recovery.py), so the run never waits on a ring
                # nobody else knows is broken.
                self.epochs.end(f"a generation on epoch {old.epoch} failed: {str(exc)[:200]}", only=ep)
                if isinstance(exc, FaultyPeer):
                    # a peer that sends NaN or malformed activations is not waited for: it is dropped
                    await self.report_fault(exc.peer, str(exc), old.epoch)
                self.notices.notice(f"ring failed during a generation ({exc}); waiting for the swarm to re-plan")
                notify(f"paused after {len(run.decoder.output_ids)} tokens: {str(exc)[:200]}; the swarm is re-planning")
                ep = await self.next_epoch(
                    old.epoch, RECOVERY_TIMEOUT_S,
                    on_wait=lambda waited: notify(f"still waiting for the swarm to re-plan ({waited:.0f} s)"),
                )  # fmt: skip
                if ep.plan.coordinator != self.peer_id:
                    raise CoordinatorMoved(
                        f"epoch {ep.plan.epoch} is coordinated by {ep.plan.coordinator} ({exc})", ep.plan.coordinator,
                        ep, failed_at, ran,
                    ) from None
                moved = {p: list(b) for p, b in ep.plan.blocks.items() if old.blocks.get(p) != b}
                replans.append({
                    "reason": str(exc)[:300],  # what this coordinator saw
                    "cause": ep.cause,  # why the leader re-planned (they differ when a hand-over races)
                    "lost": sorted({*old.ring, old.coordinator} - {*ep.plan.ring, ep.plan.coordinator}),
                    "detected_unix": round(failed_at, 3),
                    "last_token_unix": round(last_token[0], 3),
                    "ring_ready_unix": round(time.time(), 3),
                    "from_epoch": old.epoch,
                    "to_epoch": ep.plan.epoch,
                    "layers_moved": ep.plan.layers_moved,
                    "blocks_changed": moved,
                    "replayed_chunks": len(run.fed_log),
                    "resumed_at_token": len(run.decoder.output_ids),
                    # how the ring the run left ran its stages (control.StageRun; {}: none compiled):
                    # tokens it committed count for the receipt's replay note too
                    "compiled": ran,
                })  # fmt: skip
                resumed = (
                    f"resuming on epoch {ep.plan.epoch} after {time.time() - failed_at:.1f} s "
                    f"({ep.plan.layers_moved} layers moved, replaying {len(run.fed_log)} chunks)"
                )
                self.notices.notice(resumed)
                notify(resumed)

    async def next_epoch(
        self, after: int, timeout: float, on_wait: Callable[[float], None] = lambda waited: None
    ) -> Epoch:
        """The next serving epoch after ``after``; PeerError when none comes within ``timeout``,
        PlanningError when the live members cannot hold the model for PROBLEM_GRACE_S."""
        def ready() -> Epoch | None:  # coordinated here: once its ring is set up (it serves)
            ep = self.epochs.serving
            if ep is not None and ep.plan.epoch > after and (ep.serving.is_set() or ep.plan.coordinator != self.peer_id):
                return ep
            return None

        problem_since: float | None = None
        start = trio.current_time()
        next_check = start + 1.0
        next_notice = start + NOTICE_EVERY_S
        with trio.move_on_after(timeout):
            while True:  # woken by the epochs the moment one is taken or serves; else by our duties
                # (the check below may take longer than the second it waits: a busy node's
                # planner, a mock clock's jump; a deadline already past waits no more)
                ep = await self.epochs.wait_for(ready, max(0.0, min(next_check, next_notice) - trio.current_time()))
                if ep is not None:
                    return ep
                now = trio.current_time()
                if now >= next_notice:
                    next_notice = now + NOTICE_EVERY_S
                    on_wait(now - start)
                if now >= next_check:  # planning costs CPU: ask once a second
                    next_check = now + 1.0
                    problem = self.planning_problem()
                    if problem is None:
                        problem_since = None
                    elif problem_since is None:
                        problem_since = now
                    elif now - problem_since > PROBLEM_GRACE_S:
                        raise PlanningError(f"the swarm cannot serve: {problem}; it keeps waiting for peers")
        raise PeerError(f"the swarm did not recover within {timeout:.0f} s (no new plan); see the nodes' logs")
