"""Plan epochs: who plans, taking a plan, wiring its hops, and what happens when a peer goes.

    leader.py      the leader: when to plan, the plan, the set-up phases, catching up after a cut-off
    epochs.py      one plan epoch at a peer: accept the plan, load the block, end the epoch
    wiring.py      an epoch's hops: open them, accept them, run the stage worker and result reader
    recovery.py    losses, stalls, faults (and exclusion), leaving on purpose, nudging a leader
    authority.py   the finer rules behind the roles (plans in a catch-up, epoch ends, fault reports,
                   strikes, set-up blame, draft claims), pure
    bench.py       the leader's one bench: strikes and bad activations leave a member out of plans

Imports members/, ring/, compute/ and node/'s shared modules.
"""
