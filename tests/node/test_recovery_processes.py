"""Fault tolerance through the real stack: node processes are killed or frozen mid-generation
and the generation carries on, token-identical to an uninterrupted run on the same swarm."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import trio

from swarm.errors import PeerError
from swarm.model.config import ModelArgs
from swarm.node import client
from swarm.node.launch import start_local_swarm
from swarm.node.settings import model_spec
from swarm.testing.checkpoints import TinySpec, write_checkpoint

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 160


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=8, row_gain_spread=1.0), seed=5)


def _memory(ckpt: Path, layers_each: int) -> int:
    spec = model_spec(ModelArgs.from_dir(ckpt), torch.bfloat16, 1024)
    return layers_each * spec.bytes_per_layer + spec.coordinator_bytes + 1


async def _run(swarm, coord_index: int, victim: int | None, sig: int, at: int) -> dict:  # type: ignore[no-untyped-def,type-arg]
    async with client.open_client(swarm.addrs[coord_index], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        seen: list[int] = []

        def on_tokens(ids: list[int], text: str) -> None:
            before = len(seen)
            seen.extend(ids)
            if victim is not None and before < at <= len(seen):
                swarm.kill(victim, sig)

        notices: list[str] = []
        receipt = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram",
                                        timeout=150, on_tokens=on_tokens, on_notice=notices.append)
        assert seen == receipt["output_token_ids"]  # streamed: nothing lost, nothing repeated
        receipt["notices"] = notices
        return receipt


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "freeze"])
async def test_stage_lost_mid_generation(ckpt: Path, sig: int) -> None:
    with start_local_swarm(4, ckpt, dtype="bf16", memory_bytes=[_memory(ckpt, 4)] * 4, chunk_timeout=3.0) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=90)
        plan = st["plan"]
        coord = swarm.peer_ids.index(plan["coordinator"])
        stages = [swarm.peer_ids.index(p) for p in plan["ring"] if p != plan["coordinator"]]
        assert stages, plan
        reference = await _run(swarm, coord, None, sig, 0)
        victim = stages[len(stages) // 2]
        got = await _run(swarm, coord, victim, sig, 40)
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert len(got["replans"]) == 1, got["replans"]
        rp = got["replans"][0]
        assert swarm.peer_ids[victim] in rp["lost"], rp
        assert rp["resumed_at_token"] >= 40 - 8  # the kill lands while a few chunks are in flight
        assert rp["pause_s"] < 30, rp
        # the client heard of the pause and of the resume, in order, and nothing else
        assert [n.split()[0] for n in got["notices"]][:1] == ["paused"], got["notices"]
        assert got["notices"][-1].startswith(f"resuming on epoch {rp['to_epoch']}"), got["notices"]
        assert reference["notices"] == []
        if sig == signal.SIGSTOP:
            swarm.kill(victim, signal.SIGCONT)


async def test_graceful_leave_and_tail_loss(ckpt: Path) -> None:
    """A stage that leaves on purpose (SIGTERM) hands over first: its generation pauses but never
    fails. Then the tail is killed: the next generation resumes after a re-plan. Both outputs
    equal the uninterrupted run's."""
    with start_local_swarm(5, ckpt, dtype="bf16", memory_bytes=[_memory(ckpt, 3)] * 5, chunk_timeout=3.0) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=90)
        plan = st["plan"]
        coord = swarm.peer_ids.index(plan["coordinator"])
        stages = [swarm.peer_ids.index(p) for p in plan["ring"] if p != plan["coordinator"]]
        reference = await _run(swarm, coord, None, signal.SIGKILL, 0)
        leaver = stages[0]
        got = await _run(swarm, coord, leaver, signal.SIGTERM, 30)
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert len(got["replans"]) == 1, got["replans"]
        # the leader re-planned for the hand-over, whatever the coordinator saw first (the new
        # plan, or a neighbour that had already moved to it closing the old link)
        rp = got["replans"][0]
        assert rp["cause"] == f"peer {swarm.peer_ids[leaver]} is leaving", rp
        assert swarm.peer_ids[leaver] in rp["lost"], rp
        assert swarm.procs[leaver].wait(timeout=30) == 0  # it left cleanly after the hand-over
        async with client.open_client(swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=60)
        tail = swarm.peer_ids.index(st["plan"]["ring"][-1])
        if tail != coord:
            got = await _run(swarm, coord, tail, signal.SIGKILL, 30)
            assert got["output_token_ids"] == reference["output_token_ids"]
            assert swarm.peer_ids[tail] in got["replans"][0]["lost"]


async def test_a_peer_that_left_and_came_back_is_planned_again(ckpt: Path) -> None:
    """A peer leaves on purpose (SIGTERM) and is restarted with the same key, as a user does
    after Ctrl-C. It is a member like any other again: when the third peer is then lost and the
    model needs the returning one, the swarm plans it in and serves (the leader used to keep a
    peer that had once left out of every plan)."""
    with start_local_swarm(3, ckpt, dtype="bf16", memory_bytes=[_memory(ckpt, 4)] * 3, chunk_timeout=3.0) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            await client.wait_ready(h, peer, timeout=90)
        leader = swarm.peer_ids.index(min(swarm.peer_ids))
        leaver, third = [i for i in range(3) if i != leader]
        reference = await _run(swarm, leader, None, signal.SIGKILL, 0)
        swarm.kill(leaver, signal.SIGTERM)
        assert swarm.procs[leaver].wait(timeout=30) == 0
        swarm.restart(leaver)
        short = swarm.peer_ids[leaver][:16]
        with trio.fail_after(30):
            while swarm.log(leader).count(f"peer {short}… joined") + swarm.log(leader).count(f"peer {short}… rejoined") < 2:
                await trio.sleep(0.25)
        swarm.kill(third, signal.SIGKILL)  # the leader alone holds 4 of the 8 layers: it needs the returning peer
        with trio.fail_after(60):  # the swarm serves again, on a ring without the third peer
            while True:
                async with client.open_client(swarm.addrs[leader], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
                    st = await client.wait_ready(h, peer, timeout=60)
                if swarm.peer_ids[third] not in {st["plan"]["coordinator"], *st["plan"]["ring"]}:
                    break
                await trio.sleep(0.5)
        assert swarm.peer_ids[leaver] in {st["plan"]["coordinator"], *st["plan"]["ring"]}, st["plan"]
        got = await _run(swarm, leader, None, signal.SIGKILL, 0)
        assert got["output_token_ids"] == reference["output_token_ids"]


async def test_coordinator_loss_fails_fast_then_swarm_serves_again(ckpt: Path) -> None:
    with start_local_swarm(4, ckpt, dtype="bf16", memory_bytes=[_memory(ckpt, 4)] * 4, chunk_timeout=3.0) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=90)
        coord = swarm.peer_ids.index(st["plan"]["coordinator"])
        other = next(i for i in range(4) if i != coord)
        reference = await _run(swarm, coord, None, signal.SIGKILL, 0)
        async with client.open_client(swarm.addrs[other], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            seen: list[int] = []

            def on_tokens(ids: list[int], text: str) -> None:
                if len(seen) < 30 <= len(seen) + len(ids):
                    swarm.kill(coord)
                seen.extend(ids)

            with pytest.raises(PeerError):  # a clear error through the relaying peer, not a hang
                with trio.fail_after(30):
                    await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram",
                                          timeout=20, on_tokens=on_tokens)
            st2 = await client.wait_ready(h, peer, timeout=90)
            assert st2["plan"]["coordinator"] != swarm.peer_ids[coord]
            again = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram", timeout=60)
            assert again["output_token_ids"] == reference["output_token_ids"]


async def test_nan_activations_drop_the_peer_and_the_generation_completes(ckpt: Path) -> None:
    """A stage starts sending NaN mid-generation (fault injection, SIGUSR1): the next stage refuses
    the chunk naming it, the coordinator reports it, the leader re-plans without it, and the
    generation completes with the uninterrupted output."""
    with start_local_swarm(4, ckpt, dtype="bf16", memory_bytes=[_memory(ckpt, 4)] * 4, chunk_timeout=3.0) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=90)
        plan = st["plan"]
        coord = swarm.peer_ids.index(plan["coordinator"])
        stages = [swarm.peer_ids.index(p) for p in plan["ring"] if p != plan["coordinator"]]
        reference = await _run(swarm, coord, None, signal.SIGKILL, 0)
        bad = stages[0]
        got = await _run(swarm, coord, bad, signal.SIGUSR1, 40)
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert len(got["replans"]) == 1, got["replans"]
        assert "NaN" in got["replans"][0]["reason"] and swarm.peer_ids[bad] in got["replans"][0]["reason"]
        assert swarm.peer_ids[bad] not in got["ring"]
        assert swarm.alive()[bad]  # dropped from the ring, not killed
