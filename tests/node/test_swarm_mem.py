"""Whole swarms in memory (swarm/testing/memnet.py, memswarm.py): real nodes, built by the same
composition root as ``join``, on an in-memory network under trio's autojump clock. Leader
election, plan epochs, a lost peer, a frozen leader, the ``ended`` fallback, a refused leave and
a network partition run in seconds of real time, deterministically timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from swarm.errors import PeerError
from swarm.manifest.identity import Identity
from swarm.model.driver import output_sha256
from swarm.model.generate import LocalModel, generate
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 60
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=8, row_gain_spread=1.0), seed=5)


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[int]:
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32)
    return generate(model, PROMPT, eos_token_ids=(), max_new_tokens=N_NEW).output_token_ids


async def test_the_smallest_id_leads_plans_and_the_ring_serves(ckpt: Path, reference: list[int], autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        plan = await swarm.ready()
        assert all(p.leader() == swarm.ids[0] for p in swarm.peers.values())
        assert sum(b - a for a, b in plan.blocks.values()) == 8
        signers = {swarm.peers[i].epoch.signer for i in swarm.peers}
        assert len(signers) == 1 and Identity(swarm.seeds[0]).public_key in signers  # the leader signed it
        got = await swarm.generate(1, PROMPT, N_NEW, draft="none")
        assert got["output_token_ids"] == reference and got["replans"] == []
        nursery.cancel_scope.cancel()


async def test_a_member_that_over_claims_speed_and_memory_holds_layers_but_never_the_coordinator(
    ckpt: Path, reference: list[int], autojump_clock
) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: a member advertising 0.001 ms per layer and room for a million layers (signed
    claims that nobody measures) was planned as coordinator and sole stage: the role that sees
    every prompt. The leader now picks the coordinator with such claims held to its own figures
    (authority.bounded_coordinator); the layers still go where the claims say (test_authority)."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 10**6], ms_per_layer={3: 0.001})
        await swarm.start_all()
        plan = await swarm.ready()
        rogue = swarm.ids[3]
        assert plan.coordinator != rogue, plan  # (the layers it may hold: a stage sees no prompt)
        got = await swarm.generate(1, PROMPT, N_NEW, draft="none")
        assert got["output_token_ids"] == reference
        nursery.cancel_scope.cancel()


async def test_a_view_full_of_real_identities_takes_a_newcomer_and_keeps_the_plans_members(
    ckpt: Path, autojump_clock
) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: 256 connected identities (a member holding the secret) filled a node's advert
    book and locked every newcomer out. On a serving node, a connected newcomer now takes the
    place of the entry heard from least recently, but never the leader's or a plan member's,
    however stale the failure detector finds them (node/peer.py pins them); an advert of a peer
    that never connected takes nobody's place."""
    from swarm.node.members.membership import Membership
    from swarm.proto.limits import DEFAULT_LIMITS
    from swarm.testing.memswarm import SWARM_ID

    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        plan = await swarm.ready()
        node = swarm.peers[1]
        membership, detector = node.service.membership, node.service.liveness.detector
        await swarm.until(lambda: len(membership.view()) == 3 and not membership.unconfirmed(), 20, "all connected")
        pinned = {swarm.ids[0], plan.coordinator, *plan.ring} - {node.peer_id}
        now = trio.current_time()
        for i in range(DEFAULT_LIMITS.max_peers - (len(membership.view()) - 1)):
            sybil = Membership(Identity(bytes([9, i]) + bytes(30)), SWARM_ID, device=("cpu", "x"), first_seq=1)
            assert membership.offer(sybil.local, now=now, connected=True)
        for p in membership.view():
            if p not in pinned:  # every other entry heard from after the plan's members: they are the stalest
                detector.heard(p, now + 100.0)
        made_up = Membership(Identity(b"m" * 32), SWARM_ID, device=("cpu", "x"), first_seq=1)
        assert not _takes(membership, made_up.local, now, connected=False)
        newcomer = Membership(Identity(b"n" * 32), SWARM_ID, device=("cpu", "x"), first_seq=1)
        assert _takes(membership, newcomer.local, now, connected=True)
        view = membership.view()
        assert newcomer.peer_id in view and made_up.peer_id not in view
        assert pinned and pinned <= set(view)  # the leader and the plan's members
        assert len(view) == DEFAULT_LIMITS.max_peers + 1
        nursery.cancel_scope.cancel()


def _takes(membership: object, advert: object, now: float, *, connected: bool) -> bool:
    from swarm.errors import ProtocolError

    try:
        return membership.offer(advert, now=now, connected=connected)  # type: ignore[attr-defined, no-any-return]
    except ProtocolError:
        return False


def _killer(swarm: MemSwarm, at: dict[int, object]) -> object:
    """An ``on_tokens`` that does ``at[n]()`` once ``n`` tokens have streamed."""
    seen: list[int] = []

    def on_tokens(ids: list[int], text: str) -> None:
        before = len(seen)
        seen.extend(ids)
        for n in sorted(at):
            if before < n <= len(seen):
                at.pop(n)()  # type: ignore[operator]

    on_tokens.seen = seen  # type: ignore[attr-defined]
    return on_tokens


def _roles(swarm: MemSwarm, plan: object) -> tuple[int, list[int]]:
    coord = swarm.index(plan.coordinator)  # type: ignore[attr-defined]
    return coord, [swarm.index(p) for p in plan.ring if p != plan.coordinator]  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["kill", "freeze"])
async def test_a_stage_lost_mid_generation_is_replanned_around_and_the_run_resumes(
    ckpt: Path, reference: list[int], how: str, autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        victim = next(s for s in stages if s != 0)  # not the leader: the leader's own loss is below
        lose = (lambda: swarm.kill(victim)) if how == "kill" else (lambda: swarm.freeze(victim))
        on_tokens = _killer(swarm, {25: lose})
        notices: list[str] = []
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="ngram", on_tokens=on_tokens, on_notice=notices.append)
        assert got["output_token_ids"] == reference == on_tokens.seen  # type: ignore[attr-defined]
        (rp,) = got["replans"]
        assert swarm.ids[victim] in rp["lost"] and rp["resumed_at_token"] >= 25 - 8, rp
        assert notices[0].startswith("paused") and notices[-1].startswith(f"resuming on epoch {rp['to_epoch']}")
        if how == "freeze":  # back again: admitted as a new incarnation, and it serves when needed
            swarm.thaw(victim)
            await swarm.until(lambda: any("rejoined" in line and swarm.ids[victim][:16] in line
                                          for line in swarm.events[coord]), 30, "the thawed peer rejoined")  # fmt: skip
            plan = await swarm.ready()
            others = [i for i in _roles(swarm, plan)[1] if i not in (victim, 0)]
            if others:
                on_tokens = _killer(swarm, {20: lambda: swarm.kill(others[0])})
                again = await swarm.generate(coord, PROMPT, N_NEW, on_tokens=on_tokens)
                assert again["output_token_ids"] == reference
        nursery.cancel_scope.cancel()


async def test_a_member_lost_is_replanned_after_the_short_settle_and_every_stage_replays(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """Membership lost a member of the ring: the leader plans the next epoch LOSS_SETTLE_S after
    the end, not REPLAN_SETTLE_S (its view is already what the plan is made from); the run
    resumes on it, identical, every stage of the new ring having replayed its fed chunks."""
    from swarm.node.plan.leader import LOSS_SETTLE_S, REPLAN_SETTLE_S

    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        victim = next(s for s in stages if s != 0)  # not the leader (node 0)
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="ngram", on_tokens=_killer(swarm, {30: lambda: swarm.kill(victim)}))
        assert got["output_token_ids"] == reference
        (rp,) = got["replans"]
        plans = [ev for ev in swarm.events[0] if ev.startswith("life {'event': 'plan'") and f"'epoch': {rp['to_epoch']}," in ev]
        (plan,) = plans
        pause = float(plan.split("'pause_s': ")[1].split("}")[0])  # the leader's: its epoch's end -> this plan
        assert LOSS_SETTLE_S <= pause < REPLAN_SETTLE_S, plan
        workers = [p.epoch.worker for p in swarm.peers.values() if p.epoch.worker is not None]  # the new ring's
        assert len(workers) >= 2 and rp["replayed_chunks"] > 10, rp
        assert all(w.stats.replayed == rp["replayed_chunks"] for w in workers), [w.stats for w in workers]
        nursery.cancel_scope.cancel()


async def test_two_peers_lost_one_after_the_other(ckpt: Path, reference: list[int], autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[3, 3, 3, 3, 3])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        first, second = [s for s in stages if s != 0][:2]
        on_tokens = _killer(swarm, {15: lambda: swarm.kill(first), 40: lambda: swarm.kill(second)})
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="ngram", on_tokens=on_tokens)
        assert got["output_token_ids"] == reference
        lost = [rp["lost"] for rp in got["replans"]]
        assert len(lost) == 2 and swarm.ids[first] in lost[0] and swarm.ids[second] in lost[1], got["replans"]
        assert not {got["coordinator"], *got["ring"]} & {swarm.ids[first], swarm.ids[second]}
        nursery.cancel_scope.cancel()


async def test_a_partition_serves_on_both_sides_and_no_generation_fails_when_they_meet(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """Two halves that can each hold the model: cut apart, each serves on its own ring; when the
    network heals mid-generation, the swarm becomes one ring again and the generation in flight
    on either side finishes (on its coordinator, or resumed on the merged ring's): none fails,
    each equal to the uninterrupted output."""
    torch.set_num_threads(1)
    long = generate(LocalModel.load(ckpt, stages=1, dtype=torch.float32), PROMPT, eos_token_ids=(), max_new_tokens=200)
    async with trio.open_nursery() as nursery:
        net = MemNet(delay=0.02)  # 20 ms a hop: a generation is still running when the halves meet
        swarm = MemSwarm(net, ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        await swarm.ready()
        net.partition(swarm.ids[:2], swarm.ids[2:])
        for half in ([0, 1], [2, 3]):
            await swarm.until(lambda half=half: swarm.serving_plan(half) is not None
                              and set(swarm.serving_plan(half).blocks) <= {swarm.ids[i] for i in half},
                              60, f"half {half} serving on its own")  # fmt: skip
        plans = [swarm.serving_plan([0, 1]), swarm.serving_plan([2, 3])]
        assert plans[0].coordinator != plans[1].coordinator
        results: dict[int, object] = {}

        async def run(i: int) -> None:
            try:
                results[i] = await swarm.generate(i, PROMPT, 200, draft="none",
                                                  on_tokens=_killer(swarm, {20: net.heal} if i == 3 else {}))
            except Exception as exc:  # reported below, with the other half's
                results[i] = exc

        async with trio.open_nursery() as gens:
            gens.start_soon(run, 1)
            gens.start_soon(run, 3)
        for i, got in results.items():
            assert isinstance(got, dict), (i, got)
            assert got["output_token_ids"] == long.output_token_ids, i
        kept, handed = results[1], results[3]  # type: ignore[assignment]
        assert [rp.get("moved_to") for rp in handed["replans"]] == [plans[0].coordinator], handed["replans"]  # type: ignore[index]
        assert all("moved_to" not in rp for rp in kept["replans"]), kept["replans"]  # type: ignore[index]
        merged = await swarm.ready()
        assert len({p.epoch.plan.epoch for p in swarm.peers.values()}) == 1 and merged.epoch > max(p.epoch for p in plans)
        nursery.cancel_scope.cancel()


async def test_a_frozen_leader_that_comes_back_leaves_the_serving_ring_alone(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """The leader (smallest ID) is frozen until the others serve without it, then thawed in the
    middle of a generation: it leads again, but knows it was stopped and takes the epoch the
    swarm serves instead of planning from its stale view. It signs no plan, the run neither
    pauses nor fails, and the swarm's epoch and coordinator stay as they were."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        await swarm.ready()
        swarm.freeze(0)
        short = swarm.ids[0][:16]
        await swarm.until(lambda: f"peer {short}… left" in swarm.logs(1), 30, "the frozen leader declared lost")
        plan = await swarm.ready(among=[1, 2, 3])
        assert swarm.ids[0] not in {plan.coordinator, *plan.ring}
        coord = swarm.index(plan.coordinator)
        before = await swarm.generate(coord, PROMPT, N_NEW)
        plans_before = swarm.logs(0).count("plan epoch")
        got = await swarm.generate(coord, PROMPT, N_NEW, on_tokens=_killer(swarm, {20: lambda: swarm.thaw(0)}))
        assert got["output_token_ids"] == before["output_token_ids"] == reference
        await swarm.until(lambda: f"peer {short}… rejoined" in swarm.logs(1), 30, "the thawed leader admitted again")
        await trio.sleep(5.0)  # swarm time: past its settle and catch-up, any plan of its own would be out
        assert swarm.logs(0).count("plan epoch") == plans_before, swarm.logs(0)[-2000:]
        after = await swarm.generate(coord, PROMPT, N_NEW)
        assert after["output_token_ids"] == reference
        assert (after["epoch"], after["coordinator"]) == (before["epoch"], plan.coordinator), after["replans"]
        assert not got["replans"] and not after["replans"]
        assert swarm.peers[0].leader() == swarm.ids[0]  # it leads again, from the swarm's epoch
        nursery.cancel_scope.cancel()


async def test_a_member_that_loses_its_neighbour_tells_the_leader_which_replans(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """The ``ended`` fallback: the leader is a standby, and the connection between two ring
    stages breaks; only the ring sees it (the leader still hears everyone), so only the ring's
    members end the epoch. No new plan coming, they tell the leader after NUDGE_AFTER_S which
    epoch ended; the leader ends it too and re-plans; the generation resumes, unchanged."""
    from swarm.node.plan.epochs import hops

    async with trio.open_nursery() as nursery:
        net = MemNet()
        standby = {"memory_bytes": 1, "coordinator_ok": False}  # the leader holds nothing
        swarm = MemSwarm(net, ckpt, nursery, layers=[0, 3, 3, 3], overrides={0: standby})
        await swarm.start_all()
        plan = await swarm.ready()
        assert swarm.ids[0] not in {plan.coordinator, *plan.ring}
        src, dst = next((a, b) for a, b in hops(plan) if a != b)
        coord = swarm.index(plan.coordinator)
        got = await swarm.generate(coord, PROMPT, N_NEW, on_tokens=_killer(swarm, {20: lambda: net.cut(src, dst)}))
        assert got["output_token_ids"] == reference
        assert got["replans"] and got["replans"][-1]["to_epoch"] > plan.epoch, got["replans"]
        assert f"reports that epoch {plan.epoch} ended" in swarm.logs(0), swarm.logs(0)[-2000:]
        nursery.cancel_scope.cancel()


async def test_leaving_hands_over_first_and_a_leave_the_rest_cannot_cover_is_refused(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """A stage that leaves on purpose hands over first: its generation pauses but never fails,
    and the new epoch's cause names it. Then a leave the others cannot cover (they cannot hold
    the model without the leaver) is refused by the leader with the planner's words; the
    leaver goes anyway, within its bound."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(delay=0.02), ckpt, nursery, layers=[3, 3, 3, 3, 3])  # the run outlasts the hand-over
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        leaver = next(s for s in stages if s != 0)
        leaving: list[object] = []
        on_tokens = _killer(swarm, {30: lambda: leaving.append(nursery.start_soon(swarm.leave, leaver))})
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="none", on_tokens=on_tokens)
        assert got["output_token_ids"] == reference
        (rp,) = got["replans"]
        assert rp["cause"] == f"peer {swarm.ids[leaver]} is leaving" and swarm.ids[leaver] in rp["lost"], rp
        handovers = [e for e in swarm.events[leaver] if "'handover'" in e]
        assert len(handovers) == 1 and "'result': 'done'" in handovers[0], handovers
        # then the tail is killed: the next generation resumes after a re-plan, unchanged
        plan = await swarm.ready()
        tail = swarm.index(plan.ring[-1])
        if tail not in (coord, 0):
            got = await swarm.generate(coord, PROMPT, N_NEW, on_tokens=_killer(swarm, {20: lambda: swarm.kill(tail)}))
            assert got["output_token_ids"] == reference and swarm.ids[tail] in got["replans"][0]["lost"]
        # now members hold just enough layers: none of them may go without the others re-planning
        plan = await swarm.ready()
        holder = next(i for i in swarm.peers if i != 0 and swarm.ids[i] in plan.blocks)
        for i in [i for i in swarm.peers if i not in (0, holder) and swarm.ids[i] not in plan.blocks]:
            swarm.kill(i)  # standbys go: the rest needs every layer it has
        await swarm.until(lambda: len(swarm.peers[0].members()) == len(swarm.peers), 30, "the leader seeing who is left")
        t0 = trio.current_time()
        await swarm.peers[holder].leave()
        assert trio.current_time() - t0 <= 5.0 + 0.5  # LEAVE_TIMEOUT_S, whatever the leader says
        refused = [e for e in swarm.events[holder] if "'handover'" in e]
        assert "the leader refused our leave" in refused[-1] and "cannot re-plan without" in refused[-1], refused
        nursery.cancel_scope.cancel()


async def test_survivors_too_small_keep_waiting_and_say_how_much_is_missing(
    ckpt: Path, autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """Three nodes of 3 layers hold 8; after one is lost, two cannot. The generation in flight
    fails with the planner's words (not a hang), a fresh one too; the survivors stay up and the
    leader keeps saying how much memory is missing."""
    import re

    missing = re.compile(r"not enough memory.*GB short", re.S)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[3, 3, 3])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        victim = next(s for s in stages if s != 0)
        with trio.fail_after(15):  # bounded: detection + settle + a few planning attempts
            with pytest.raises(PeerError) as in_flight:
                await swarm.generate(coord if coord != victim else 0, PROMPT, N_NEW,
                                     on_tokens=_killer(swarm, {5: lambda: swarm.kill(victim)}))  # fmt: skip
        assert missing.search(str(in_flight.value)), in_flight.value
        with pytest.raises(PeerError) as fresh:
            await swarm.generate(0, PROMPT, 8, wait_s=5)
        assert missing.search(str(fresh.value)), fresh.value
        assert re.search(r"cannot plan yet: not enough memory.*GB short", swarm.logs(0)), swarm.logs(0)[-2000:]
        await trio.sleep(3.0)
        assert set(swarm.peers) == {i for i in range(3) if i != victim}
        nursery.cancel_scope.cancel()


async def test_a_lost_coordinator_fails_fast_then_the_swarm_serves_again(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """The coordinator dies mid-generation: the client, through a relaying peer, gets a clear
    error (not a hang); the swarm re-plans with another coordinator and serves the same output."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(delay=0.005), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, _ = _roles(swarm, await swarm.ready())
        other = next(i for i in swarm.peers if i != coord)
        with pytest.raises(PeerError), trio.fail_after(30):
            await swarm.generate(other, PROMPT, N_NEW, draft="none", timeout=20,
                                 on_tokens=_killer(swarm, {30: lambda: swarm.kill(coord)}))  # fmt: skip
        plan = await swarm.ready()
        assert plan.coordinator != swarm.ids[coord]
        again = await swarm.generate(other, PROMPT, N_NEW, draft="ngram")
        assert again["output_token_ids"] == reference
        nursery.cancel_scope.cancel()


async def test_a_client_that_resumes_outlives_its_lost_coordinator(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """``client.generate(resume=True)``, as ``shard-swarm generate`` runs (genstream.resuming):
    the coordinator dies mid-generation; the client asks again, through the same relaying peer,
    from the prompt plus the tokens it had, and its receipt covers the whole output: every token
    it streamed, in order, the ones before the loss one box's."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(delay=0.005), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, _ = _roles(swarm, await swarm.ready())
        other = next(i for i in swarm.peers if i != coord)
        notes: list[str] = []
        streamed = _killer(swarm, {30: lambda: swarm.kill(coord)})
        with trio.fail_after(120):
            got = await swarm.generate(other, PROMPT, N_NEW, draft="none", timeout=20, resume=True,
                                       on_notice=notes.append, on_tokens=streamed)  # fmt: skip
        (at,) = got["resumed_at_tokens"]
        assert got["prompt_token_ids"] == PROMPT and got["output_token_ids"] == streamed.seen  # type: ignore[attr-defined]
        assert len(streamed.seen) == N_NEW and streamed.seen[:at] == reference[:at] and at >= 30  # type: ignore[attr-defined]
        assert got["output_sha256"] == output_sha256(streamed.seen)  # type: ignore[attr-defined]
        assert any(f"after {at} tokens" in n and "resuming on the next coordinator" in n for n in notes), notes
        nursery.cancel_scope.cancel()


async def test_nan_activations_drop_the_peer_and_the_generation_completes(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """A stage starts sending NaN mid-generation (fault injection): the next stage refuses the
    chunk naming it, the leader re-plans without it, the run completes unchanged, and the bad
    peer is dropped from the ring, not killed."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        bad = next(s for s in stages if s != 0)
        got = await swarm.generate(coord, PROMPT, N_NEW, on_tokens=_killer(swarm, {30: swarm.peers[bad].start_corrupting}))
        assert got["output_token_ids"] == reference
        (rp,) = got["replans"]
        assert "NaN" in rp["reason"] and swarm.ids[bad] in rp["reason"], rp
        assert swarm.ids[bad] not in got["ring"] and bad in swarm.peers
        nursery.cancel_scope.cancel()


async def test_a_peer_frozen_while_the_new_ring_is_set_up(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """A stage is killed and, at the same moment, another frozen: the first re-plan still counts
    on the frozen one, so that set-up must fail as soon as it is declared lost (not at the load
    timeout, minutes away); the re-plan after it resumes the run, unchanged."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[3, 3, 3, 3, 3, 3])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        killed, frozen = [s for s in stages if s != 0][:2]

        def both() -> None:
            swarm.freeze(frozen)
            swarm.kill(killed)

        with trio.fail_after(60):  # the load timeout is 600 s: a stall shows here
            got = await swarm.generate(coord, PROMPT, N_NEW, timeout=50, on_tokens=_killer(swarm, {30: both}))
        assert got["output_token_ids"] == reference
        lost = {p for rp in got["replans"] for p in rp["lost"]}
        assert {swarm.ids[killed], swarm.ids[frozen]} <= lost, got["replans"]
        nursery.cancel_scope.cancel()


async def test_a_peer_lost_during_prefill_replays_nothing_and_resends(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A 300-token prompt (5 prefill chunks); a ring stage is frozen just before the request and
    killed 0.4 s later: no result came back, so nothing is replayed; the in-flight prefill is
    sent again on the new ring, and the output is unchanged."""
    long_prompt = [(i * 37 + 11) % 251 for i in range(300)]
    ckpt = write_checkpoint(ckpt.parent / "long", TinySpec(n_layers=8, row_gain_spread=1.0, max_position_embeddings=1024),
                            seed=5)  # fmt: skip
    torch.set_num_threads(1)
    want = generate(LocalModel.load(ckpt, stages=1, dtype=torch.float32), long_prompt, eos_token_ids=(),
                    max_new_tokens=40).output_token_ids  # fmt: skip
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        victim = next(s for s in stages if s != 0)
        first: list[float] = []
        killed: list[float] = []

        async def killer() -> None:
            await trio.sleep(0.4)
            killed.append(trio.current_time())
            swarm.kill(victim)

        swarm.freeze(victim)
        nursery.start_soon(killer)
        got = await swarm.generate(coord, long_prompt, 40, draft="ngram", timeout=90,
                                   on_tokens=lambda ids, text: first.append(trio.current_time()))  # fmt: skip
        assert killed[0] < first[0]
        assert got["output_token_ids"] == want
        (rp,) = got["replans"]
        assert swarm.ids[victim] in rp["lost"] and rp["resumed_at_token"] == 0 and rp["replayed_chunks"] == 0, rp
        nursery.cancel_scope.cancel()


async def test_a_peer_that_left_and_came_back_is_planned_again(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """A peer leaves on purpose and is restarted with the same key: it is a member like any other
    again, so when the third peer is lost and the model needs the returning one, it is planned."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        await swarm.ready()
        leaver, third = 1, 2
        await swarm.leave(leaver)
        await swarm.start(leaver)
        short = swarm.ids[leaver][:16]
        await swarm.until(lambda: swarm.logs(0).count(f"peer {short}… joined") + swarm.logs(0).count(
            f"peer {short}… rejoined") >= 2, 30, "the returning peer admitted again")  # fmt: skip
        swarm.kill(third)  # the leader alone holds 4 of the 8 layers: it needs the returning peer
        await swarm.until(lambda: (p := swarm.serving_plan()) is not None and swarm.ids[third] not in p.blocks,
                          60, "a ring without the third peer")  # fmt: skip
        assert swarm.ids[leaver] in swarm.serving_plan().blocks
        got = await swarm.generate(0, PROMPT, N_NEW)
        assert got["output_token_ids"] == reference
        nursery.cancel_scope.cancel()


async def test_a_late_joiner_becomes_a_standby_and_relays(ckpt: Path, reference: list[int], autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A peer that joins while the ring serves does not disturb it: it becomes a standby, learns
    the plan, and serves requests by relaying them to the coordinator."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4], overrides={})
        swarm.layers = [4, 4, 4]
        for i in range(2):
            swarm.overrides[i] = {"expect_peers": 2}
        await swarm.start(0)
        await swarm.start(1)
        before = await swarm.ready()
        late = await swarm.start(2)
        await swarm.until(lambda: late.epoch is not None, 20, "the newcomer told the serving plan")
        assert late.epoch.plan.epoch == before.epoch and swarm.ids[2] not in late.epoch.plan.blocks  # a standby
        assert all(p.epoch.plan.epoch == before.epoch for p in swarm.peers.values())  # nobody re-planned
        got = await swarm.generate(2, PROMPT, N_NEW, draft="none")
        assert got["output_token_ids"] == reference and got["coordinator"] == before.coordinator
        nursery.cancel_scope.cancel()


async def test_a_hop_gone_silent_with_every_peer_alive_is_replanned(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """A stage stops passing activations on but stays up, answering heartbeats (the stall a
    relayed stream that died silently causes). Nobody is lost, so only the coordinator can tell:
    its run gets no result within the chunk deadline, it ends the epoch, the leader re-plans the
    same peers, and the generation resumes, identical."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        stage = stages[0] if stages else coord
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="ngram",
                                   on_tokens=_killer(swarm, {20: swarm.peers[stage].start_swallowing}))  # fmt: skip
        assert got["output_token_ids"] == reference
        assert set(swarm.peers) == {0, 1, 2}
        assert len(got["replans"]) == 1 and got["replans"][0]["lost"] == [], got["replans"]
        assert "no result from the ring" in got["replans"][0]["reason"], got["replans"]
        nursery.cancel_scope.cancel()


async def test_a_joiner_learns_the_serving_plan_after_the_leader_that_made_it_left(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """The leader (smallest ID) holds nothing of the ring; it leaves (Ctrl-C) and the ring serves
    on, since nothing of it was lost. A peer that joins after that learns the serving plan from
    the new leader (which did not sign it), becomes a standby and relays; nobody re-plans."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4])
        swarm.overrides = {0: {"coordinator_ok": False, "memory_bytes": 1, "expect_peers": 3},
                           1: {"expect_peers": 3}, 2: {"expect_peers": 3},
                           3: {"bootstrap": (f"/memory/{swarm.ids[1]}/p2p/{swarm.ids[1]}",)}}  # fmt: skip
        for i in range(3):
            await swarm.start(i)
        before = await swarm.ready()
        assert swarm.ids[0] not in {before.coordinator, *before.ring}
        await swarm.leave(0)
        late = await swarm.start(3)
        await swarm.until(lambda: late.epoch is not None, 30, "the newcomer told the serving plan")
        assert late.epoch.plan.epoch == before.epoch and swarm.ids[3] not in late.epoch.plan.blocks
        assert all(p.epoch.plan.epoch == before.epoch for p in swarm.peers.values())  # nobody re-planned
        got = await swarm.generate(3, PROMPT, N_NEW, draft="none")
        assert got["output_token_ids"] == reference and got["coordinator"] == before.coordinator
        nursery.cancel_scope.cancel()


async def test_a_run_that_times_out_before_the_detector_judges_waits_for_the_verdict(
    ckpt: Path, reference: list[int], autojump_clock  # type: ignore[no-untyped-def]
) -> None:
    """The coordinator's chunk deadline (1.5 s here) passes before the failure detector declares
    a frozen stage lost (2.5 s): the run ends its epoch at once, and the leader, seeing the stage
    suspect, waits for the verdict and plans once, around it (not a plan that keeps the frozen
    stage and fails again at set-up)."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4, 4], chunk_timeout=1.5)
        await swarm.start_all()
        coord, stages = _roles(swarm, await swarm.ready())
        victim = next(s for s in stages if s != 0)
        got = await swarm.generate(coord, PROMPT, N_NEW, draft="ngram",
                                   on_tokens=_killer(swarm, {20: lambda: swarm.freeze(victim)}))  # fmt: skip
        assert got["output_token_ids"] == reference
        (rp,) = got["replans"]
        assert swarm.ids[victim] in rp["lost"] and "no result from the ring" in rp["reason"], rp
        assert rp["to_epoch"] == rp["from_epoch"] + 1, rp  # one plan, made after the verdict
        nursery.cancel_scope.cancel()


async def test_generations_sharing_the_ring_decode_plainly_unless_they_asked_for_a_drafter(
    ckpt: Path, reference: list[int], autojump_clock
) -> None:  # type: ignore[no-untyped-def]
    """drafting.py, sharing the ring: requests that name no drafter get the node's default prompt
    lookup alone, and plain decoding when they share the ring (the receipt says so and why); one
    that names ngram keeps it. Every output equals one box's."""
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[4, 4, 4])
        await swarm.start_all()
        await swarm.ready()
        alone = await swarm.generate(1, PROMPT, N_NEW)
        got: dict[str, dict] = {}

        async def one(name: str, **kw: object) -> None:
            got[name] = await swarm.generate(1, PROMPT, N_NEW, **kw)

        async with trio.open_nursery() as inner:
            for name, kw in (("a", {}), ("b", {}), ("named", {"draft": "ngram"})):
                inner.start_soon(lambda n=name, k=kw: one(n, **k))
        for r in (alone, *got.values()):
            assert r["output_token_ids"] == reference
        assert alone["draft"]["ran"] == "ngram" and "shared_with" not in alone["draft"]
        for r in (got["a"], got["b"]):
            assert r["draft"]["ran"] == "none" and r["draft"]["shared_with"] == 2 and r["draft"]["max_depth"] == 1
            assert "shared the ring" in r["draft"]["why"]
        assert got["named"]["draft"]["ran"] == "ngram"
        nursery.cancel_scope.cancel()
