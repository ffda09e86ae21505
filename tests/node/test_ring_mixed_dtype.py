"""A mixed ring through the real stack: one ``python -m swarm.node`` process serving fp32 (an AVX2
CPU's ``auto``) and one serving bf16 (a GPU's), on loopback, serve the bundled model together.

The promise: each stage computes in its own dtype and casts what it receives to that dtype at the
boundary (node/ring/codec.py), so the ring computes exactly what one process computes holding the
same blocks in the same dtypes with the same casts and the same chunks: greedy tokens identical.
Both run on this CPU, so this holds on any CPU (no stored figure depends on its bf16 rounding).
And the planner budgets each peer in its own dtype: the fp32 peer advertises its memory at half
(settings.plan_memory), so its block's fp32 bytes fit what it offered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm import client
from swarm.launch import start_local_swarm
from swarm.model.bundled import default_model_dir
from swarm.model.dtypes import NAMES
from swarm.model.stage import Head, Stage
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import open_checkpoint
from swarm.node.settings import model_spec

pytestmark = pytest.mark.slow
NEW = 16
DTYPES = ["fp32", "bf16"]


def one_process(model_dir: Path, ids: list[int], blocks: list[tuple[tuple[int, int], torch.dtype]],
                head_dtype: torch.dtype) -> list[int]:
    """Greedy with the ring's blocks, dtypes and chunk schedule (prompt in one chunk, then one
    token per chunk: draft none), each block's input cast to its dtype, the head's to its own."""
    ck = open_checkpoint(model_dir)
    head = Head.load(ck.args, ck.source, dtype=head_dtype)
    stages = [Stage.load(ck.args, ck.source, a, b, dtype=dt) for (a, b), dt in blocks]
    for st in stages:
        st.open_session("s", 256)
    out: list[int] = []
    chunk = list(ids)
    with torch.inference_mode():
        while len(out) < NEW:
            h = head.embed(torch.tensor(chunk))
            for st in stages:
                h = st.forward("s", h.to(st.dtype))
            tok = int(head.logits(h[-1:].to(head_dtype))[-1].argmax())
            out.append(tok)
            chunk = [tok]
    return out


async def test_an_fp32_and_a_bf16_peer_serve_together_as_one_process_would() -> None:
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}]))
    assert len(ids) <= 64  # one prefill chunk
    with start_local_swarm(2, model_dir, dtype=DTYPES, context_tokens=256, draft="none") as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=240)
            receipt = await client.generate(h, peer, prompt_ids=ids, max_new_tokens=NEW, draft="none", timeout=180)
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(2)]
        peer_ids = list(swarm.peer_ids)
    dtype_of = {pid: NAMES[DTYPES[i]] for i, pid in enumerate(peer_ids)}
    plan_blocks = {pid: tuple(b) for pid, b in st["plan"]["blocks"].items()}
    assert sum(b - a for a, b in plan_blocks.values()) == 30, st["plan"]
    assert set(plan_blocks) == set(peer_ids), "both peers hold layers: the ring really mixes dtypes"
    blocks = sorted(((blk, dtype_of[pid]) for pid, blk in plan_blocks.items()), key=lambda x: x[0][0])
    want = one_process(model_dir, ids, blocks, dtype_of[receipt["coordinator"]])
    got = receipt["output_token_ids"]
    assert got == want[: len(got)] and (len(got) == NEW or receipt["finish_reason"] == "eos")
    # each peer's block, in its own dtype, fits the memory its node was given (launch: per dtype)
    ck = open_checkpoint(model_dir)
    for pid, (a, b) in plan_blocks.items():
        own = model_spec(ck.args, dtype_of[pid], 256)
        advert = next(p["memory_bytes"] for p in receipt["peers"] if p["id"] == pid)
        held = own.block_bytes(a, b) + (own.coordinator_bytes if pid == receipt["coordinator"] else 0)
        offered = advert * (2 if dtype_of[pid] == torch.float32 else 1)  # back from the planner's unit
        assert held <= offered, (pid, held, offered)
