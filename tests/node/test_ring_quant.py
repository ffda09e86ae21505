"""A quantized swarm through the real stack: three ``python -m swarm.node`` processes on loopback
serve the bundled model with int8 / int4 weights (the invite's ``quant``, budgeted by the planner
at its compact size) and the coordinator's LM head int8 (capability.swarm_head_quant), and
``shard-swarm run --receipt`` (the receipt's quant, head, draft and depth) gives the same greedy tokens. bf16 activations, the dtype the packed kernels serve: the ring and ``run`` compute
the same chunks on the same CPU, so they agree bit for bit (no stored figure depends on this CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm import client
from swarm.launch import start_local_swarm
from swarm.model.bundled import default_model_dir
from swarm.model.capability import choose_head_quant
from swarm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
NEW = 24


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.mark.parametrize("quant", ["int4", "int8"])
async def test_quantized_ring_matches_run_quant(model_dir: Path, quant: str, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}]))
    with start_local_swarm(3, model_dir, dtype="bf16", quant=quant, context_tokens=256) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=240)
            receipt = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=NEW, draft="ngram", timeout=180)
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(3)]
    assert sum(b - a for a, b in st["plan"]["blocks"].values()) == 30, st["plan"]
    assert receipt["quant"] == quant
    # the coordinator's head as run --quant auto holds it: the bundled model's Q8_0-stored head int8
    assert receipt["head_quant"] == choose_head_quant("int8", torch.device("cpu"), torch.bfloat16)
    assert len(receipt["output_token_ids"]) == NEW or receipt["finish_reason"] == "eos"
    (tmp_path / "receipt.json").write_text(json.dumps(receipt))
    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "run", "--model", str(model_dir), "--stages", "3",
         "--dtype", "bf16", "--receipt", str(tmp_path / "receipt.json"), "--threads", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    local = json.loads(out.stdout)
    assert local["quant"] == quant and local["head_quant"] == receipt["head_quant"]
    assert local["output_token_ids"] == receipt["output_token_ids"]
    assert local["output_sha256"] == receipt["output_sha256"]
