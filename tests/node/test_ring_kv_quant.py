"""An int8 KV cache through the real stack: three ``python -m swarm.node`` processes on loopback
serve the bundled model with the invite's ``kv_cache: int8`` (every stage holds its sessions'
keys and values as int8 with a scale per token and head), and ``shard-swarm run --receipt``
replays the ring's receipt in one process with the same three stages and the same format: the
same greedy tokens. Greedy identity with an unquantized box is not promised (the cache is
rounded); the one-process int8 run is the reference, and both compute the same chunks on the same
CPU, so they agree bit for bit (no stored figure depends on this CPU)."""

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
NEW = 24


async def test_an_int8_kv_ring_matches_one_process_with_int8_kv(tmp_path: Path) -> None:
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}]))
    with start_local_swarm(3, model_dir, dtype="bf16", kv_cache="int8", context_tokens=256) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=240)
            receipt = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=NEW, draft="ngram", timeout=180)
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(3)]
    blocks = sorted(tuple(b) for b in st["plan"]["blocks"].values())
    assert sum(b - a for a, b in blocks) == 30, st["plan"]
    assert receipt["kv_cache"] == "int8"
    assert len(receipt["output_token_ids"]) == NEW or receipt["finish_reason"] == "eos"
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(receipt))

    def run(*extra: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "swarm.cli.main", "run", "--model", str(model_dir), "--stages", "3",
             "--dtype", "bf16", "--receipt", str(path), "--threads", "1", "--json", *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    local = run()  # the receipt's kv_cache: int8
    assert local["kv_cache"] == "int8"
    assert local["output_token_ids"] == receipt["output_token_ids"]
    assert local["output_sha256"] == receipt["output_sha256"]
