"""A draft model through the real stack: three ``python -m swarm.node`` processes on loopback,
each hop delayed 25 ms one way (a WAN), serve the bundled model with ``draft="auto"`` (an int4
copy of the model as the draft). The coordinator drafts with it when asked and when ``auto``
finds it pays on this slow ring; ``shard-swarm run --receipt`` replays the receipt's drafter and
policy and gives the same greedy tokens (bf16: the same chunks on the same CPU, bit for bit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import client
from swarm.launch import start_local_swarm
from swarm.model.bundled import default_model_dir
from swarm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
NEW = 32


async def test_a_model_draft_on_a_slow_ring_matches_run_receipt(tmp_path: Path) -> None:
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}]))
    receipts = {}
    with start_local_swarm(3, model_dir, dtype="bf16", draft="auto", delay_ms=25.0, context_tokens=256) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            await client.wait_ready(h, peer, timeout=240)
            for draft in ("model", "auto", "none"):
                receipts[draft] = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=NEW, draft=draft,
                                                        timeout=180)  # fmt: skip
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(3)]
    model, auto, none = receipts["model"], receipts["auto"], receipts["none"]
    assert model["draft"]["ran"] == "int4" and model["draft"]["policy"]["draft_ms"] > 0
    assert auto["draft"]["ran"] == "int4" and "predicted tok/s" in auto["draft"]["why"]  # it pays on 100 ms rings
    assert model["accepted_per_round"] > 0.5 and model["draft"]["mean_in_flight"] > 1.0
    assert none["draft"]["ran"] == "none" and none["draft"]["max_depth"] == 1
    for name in ("model", "auto"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(receipts[name]))
        out = subprocess.run(
            [sys.executable, "-m", "swarm.cli.main", "run", "--model", str(model_dir), "--stages", "3",
             "--dtype", "bf16", "--receipt", str(path), "--threads", "1", "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        local = json.loads(out.stdout)
        assert local["draft"] == "int4" and local["matches_receipt"] is True, (name, local, receipts[name]["draft"])
        assert local["output_sha256"] == receipts[name]["output_sha256"]
