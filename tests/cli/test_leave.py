"""Leaving with Ctrl-C through ``shard-swarm join`` processes: bounded in every case, and quiet.

A node alone, a leader that holds the whole ring while two standbys are up, and the two
survivors stopped at the same moment: each exits 0 within the stated bound (LEAVE_TIMEOUT_S plus
the host's close), and a leader that leaves hands leadership over, so the next leader plans
exactly once. Start-ups are slow on a busy machine (each process loads torch); only the leave
itself is held to the bound. ``join --json`` events are what the test reads.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from swarm.node.plan.recovery import LEAVE_TIMEOUT_S
from tests.cli.joinkit import N_LAYERS, JoinProc, Lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BOUND_S = LEAVE_TIMEOUT_S + 7.0  # the leave's wait, the host's close, and slack for a loaded 2-core box
START_S = 300.0


def _exit_within(lab: Lab, procs: list[JoinProc]) -> list[float]:
    t0 = time.monotonic()
    for p in procs:
        p.interrupt()
    took = []
    for p in procs:
        rc = p.proc.wait(timeout=BOUND_S + 20)
        took.append(time.monotonic() - t0)
        assert rc == 0, p.tail()
        assert not any("Traceback" in line for line in p.stderr), p.tail()
    assert max(took) < BOUND_S, (took, [p.tail() for p in procs])
    return took


def test_alone_the_json_life_and_a_bounded_leave(tmp_path: Path) -> None:
    lab = Lab(tmp_path, 1)
    try:
        n = lab.start(0, N_LAYERS)
        lab.wait(lambda: bool(n.of("serving")), START_S, "the lone node to serve")
        me = lab.ids[0].peer_id
        (plan,) = n.of("plan")
        assert plan["epoch"] == 1 and plan["role"] == "coordinator+stage" and plan["cause"] == "first plan"
        assert plan["block"] == [0, N_LAYERS] and plan["coordinator"] == me and plan["ring"] == [me]
        loading = n.of("loading")
        assert [e["done"] for e in loading] == [False, True] and all(e["layers"] == [0, N_LAYERS] for e in loading)
        assert n.of("serving")[0]["epoch"] == 1
        _exit_within(lab, [n])
        assert n.of("leaving") == [{"event": "leaving", "in_ring": True, "members": 0}]
        assert n.of("handover")[0]["result"].startswith("alone")
        # said once each: no line repeated on stderr (a notice once, not also as a log line)
        said = [line.split(": ", 1)[-1] if " INFO " in line else line for line in n.stderr]
        assert len(said) == len(set(said)), n.stderr
    finally:
        lab.close()


def test_leader_hands_over_then_everyone_leaves_at_once(tmp_path: Path) -> None:
    lab = Lab(tmp_path, 3)
    try:
        lead = 0  # the smallest peer ID
        # the leader can hold the whole model (and, alone, serves it); the others half each:
        # without the leader, the two of them still hold it
        # started first, it plans alone; the others join its ring as standbys
        leader = lab.start(lead, N_LAYERS)
        lab.wait(lambda: bool(leader.of("serving")), START_S, "the leader serving alone")
        rest = [lab.start(i, N_LAYERS // 2) for i in range(3) if i != lead]
        lab.wait(lambda: all(p.of("plan") for p in rest), START_S, "the standbys to learn the plan")
        ids = [lab.ids[i].peer_id for i in (1, 2)]
        lab.wait(lambda: all(any(e["peer"] == ids[1 - k] for e in p.of("rtt")) for k, p in enumerate(rest)), 60,
                 "the standbys to know each other (an RTT measured)")  # fmt: skip
        first = leader.of("plan")[-1]
        lid = lab.ids[lead].peer_id
        assert first["ring"] == [lid] and first["coordinator"] == lid, first  # the leader holds the ring
        assert all(p.of("plan")[-1]["role"] == "standby" for p in rest)

        _exit_within(lab, [leader])
        assert leader.of("handover")[0]["result"] == "done", leader.tail()
        assert not leader.of("waiting"), leader.tail()  # it never tried to plan while leaving
        # the next leader plans once; both survivors serve that one epoch
        lab.wait(lambda: all(len(p.of("plan")) >= 2 and p.of("serving") for p in rest), 60, "the re-plan")
        time.sleep(3.0)  # long enough to see a second re-plan if there were one
        for p in rest:
            plans = p.of("plan")
            assert [e["epoch"] for e in plans] == [first["epoch"], first["epoch"] + 1], p.tail()
            assert plans[-1]["cause"] == f"peer {lid} is leaving" and lid not in plans[-1]["ring"], plans[-1]
            assert p.of("serving")[-1]["epoch"] == first["epoch"] + 1
        assert sorted(b for p in rest for b in [p.of("plan")[-1]["block"]]) == [[0, 3], [3, 6]]

        _exit_within(lab, rest)  # all at once: nobody waits for a hand-over nobody can give
        for p in rest:
            assert len(p.of("plan")) == 2, p.tail()  # and nobody re-planned while leaving
    finally:
        lab.close()
