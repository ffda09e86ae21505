"""Recovery on the user's path: ``shard-swarm join`` processes on loopback, a stage killed in
the middle of a generation. The in-memory swarm tests (tests/node/test_swarm_mem.py) cover the
faults one by one; this is the thin layer that proves them through the real stack: processes,
libp2p, admission, the fast path, SIGKILL."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import trio

from swarm import client
from swarm.model.generate import LocalModel, generate
from tests.cli.joinkit import N_LAYERS, Lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 120
START_S = 300.0


async def test_a_stage_killed_mid_generation_through_join_processes(tmp_path: Path) -> None:
    lab = Lab(tmp_path, 4)
    try:
        procs = [lab.start(i, N_LAYERS // 3) for i in range(4)]  # 2 layers each: the ring needs three
        await trio.to_thread.run_sync(lambda: lab.wait(
            lambda: any(e["role"].startswith("coordinator") for p in procs for e in p.of("plan"))
            and any(p.of("serving") and p.of("plan")[-1]["role"].startswith("coordinator") for p in procs),
            START_S, "the ring serving"))  # fmt: skip
        plan = next(p.of("plan")[-1] for p in procs if p.of("plan") and p.of("plan")[-1]["role"].startswith("coordinator"))
        ids = [i.peer_id for i in lab.ids]
        victims = [p for p in plan["ring"] if p not in (plan["coordinator"], ids[0])]
        assert victims, plan  # three stages: one is neither the coordinator nor the peer we ask
        victim = ids.index(victims[0])
        torch.set_num_threads(1)
        want = generate(LocalModel.load(lab.ckpt, stages=1, dtype=torch.float32), PROMPT, eos_token_ids=(),
                        max_new_tokens=N_NEW).output_token_ids  # fmt: skip
        seen: list[int] = []

        def on_tokens(ids_: list[int], text: str) -> None:
            if len(seen) < 25 <= len(seen) + len(ids_):
                procs[victim].proc.send_signal(signal.SIGKILL)
            seen.extend(ids_)

        from swarm.manifest.manifest import read_manifest

        m = read_manifest(lab.invite)
        async with client.open_client(list(m.bootstrap), secret=m.secret.value, swarm_id=m.swarm_id) as (h, peer):
            got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram", timeout=150,
                                        on_tokens=on_tokens)  # fmt: skip
        assert seen == got["output_token_ids"] == want
        (rp,) = got["replans"]
        assert ids[victim] in rp["lost"] and rp["resumed_at_token"] >= 25 - 8, rp
        assert all(p.proc.poll() is None for i, p in enumerate(procs) if i != victim), [p.tail() for p in procs]
    finally:
        lab.close()
