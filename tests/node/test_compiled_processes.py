"""Compiled stages through the real stack (``join --compile``: launch.py's ``compile``): node
processes compile their stage's decode step (one-token steps and verify chunks) before the ring
serves, the ring's fp32 greedy tokens equal one eager process's (without drafting, and with the
ngram drafter's verify chunks through the compiled graphs), and a stage killed mid-generation re-plans onto the survivors,
which compile their new blocks, replay the session and end exactly as one box does.

Inductor's on-disk cache (its default, /tmp/torchinductor_$USER) is shared by the node processes
and by every run after the first, so a second run loads the graphs instead of compiling them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm import client
from swarm.launch import offer_for, start_local_swarm
from swarm.model.generate import LocalModel, generate
from swarm.testing.checkpoints import TinySpec, write_checkpoint

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 80  # past position 64: both compiled spans (64, 128) serve the generation


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=6, row_gain_spread=1.0), seed=3)


async def test_compiled_ring_equals_one_eager_box_and_resumes_identical_after_a_kill(ckpt: Path) -> None:
    torch.set_num_threads(1)
    want = generate(LocalModel.load(ckpt, stages=1, dtype=torch.float32), PROMPT, max_new_tokens=N_NEW,
                    eos_token_ids=()).output_token_ids  # fmt: skip
    memory = offer_for(ckpt, 3, context_tokens=256)  # each holds 3 of the 6 layers: two serve, one stands by
    with start_local_swarm(3, ckpt, dtype="fp32", memory_bytes=[memory] * 3, context_tokens=256, chunk_timeout=5.0,
                           compile=True, compile_span=128) as swarm:  # fmt: skip
        # a --compile node listens once its speed probe ran through a compiled step: on a loaded
        # box (two workers, cold graphs) that alone took over a minute, so the dial gets the ring's wait
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id,
                                      timeout=240) as (h, peer):  # fmt: skip
            st = await client.wait_ready(h, peer, timeout=240)
        plan = st["plan"]
        coord = swarm.peer_ids.index(plan["coordinator"])
        stages = [swarm.peer_ids.index(p) for p in plan["ring"]]
        async with client.open_client(swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            for i in stages:  # every stage compiled both spans before the ring served
                async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (hi, pi):
                    comp = (await client.status(hi, pi))["compiled"]
                assert comp is not None and comp["spans"] == [64, 128] and comp["capacity"] == 256 and comp["eager"] is None, (i, comp)
                assert comp["rows"] == [1, 2, 4, 8], comp  # verify chunks of up to 8 rows compiled too
            got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="none", timeout=60)
            assert got["output_token_ids"] == want and got["replans"] == []
            # the receipt names each stage node's compiled spans and where its steps turn eager
            ran = {p["id"]: p["compiled"] for p in got["peers"] if p["block"]}
            assert set(ran) == set(plan["ring"]) and got["replay_note"] is None, got["peers"]
            assert all(r == {"spans": [64, 128], "eager_from": 128, "eager": None, "dtype": "fp32"} for r in ran.values()), ran
            victim = next(i for i in stages if i != coord)
            seen = [0]

            def on_tokens(ids: list[int], text: str) -> None:
                seen[0] += len(ids)
                if seen[0] >= 30 and swarm.alive()[victim]:
                    swarm.kill(victim)

            again = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram", timeout=240,
                                          on_tokens=on_tokens)  # fmt: skip
            assert not swarm.alive()[victim]
            assert again["output_token_ids"] == want
            assert len(again["replans"]) == 1 and swarm.peer_ids[victim] in again["replans"][0]["lost"], again["replans"]
            # the ring it left ran compiled too (fp32: no replay note), as the re-plan's entry says
            left = again["replans"][0]["compiled"]
            assert set(left) == set(plan["ring"]) and all(r["spans"] == [64, 128] for r in left.values()), left
            assert again["replay_note"] is None
            # ... and after the re-plan, the new ring's (the standby compiled the block it took)
            assert {p["id"] for p in again["peers"] if (p["compiled"] or {}).get("spans") == [64, 128]} == \
                {p["id"] for p in again["peers"] if p["block"]}, again["peers"]
            now = (await client.status(h, peer))["plan"]
        for p, block in now["blocks"].items():  # the new ring's stages (a standby's block) compiled theirs
            i = swarm.peer_ids.index(p)
            async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (hi, pi):
                comp = (await client.status(hi, pi))["compiled"]
            assert comp["layers"] == block and comp["spans"] == [64, 128], (i, block, comp)
