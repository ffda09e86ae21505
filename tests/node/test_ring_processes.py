"""The ring through the real stack: node processes on loopback, libp2p, admission, the planner.

Each test starts real ``python -m swarm.node`` processes and compares what the swarm generates
with the in-process reference (``swarm.model.generate``) on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from swarm import client
from swarm.launch import start_local_swarm
from swarm.model.drafters import NgramDrafter
from swarm.model.generate import LocalModel, generate
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import KPolicy
from swarm.testing.checkpoints import TinySpec, write_checkpoint

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=6, row_gain_spread=1.0), seed=3)


def _reference(ckpt: Path, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32)
    return generate(model, PROMPT, eos_token_ids=(), **kw).output_token_ids


async def test_three_node_ring_matches_one_box(ckpt: Path) -> None:
    want_greedy = _reference(ckpt, max_new_tokens=40, drafter=NgramDrafter(), policy=KPolicy(max_depth=2))
    want_sampled = _reference(ckpt, max_new_tokens=24, params=SamplingParams(temperature=0.8, top_p=0.9, seed=7))
    with start_local_swarm(3, ckpt, dtype="fp32") as swarm:
        async with client.open_client(swarm.addrs[1], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=90)
            plan = st["plan"]
            # the coordinator's first hop goes over the sealed direct socket (or stays in-process)
            assert st["hop_paths"].get("0") in ("direct", "local"), st["hop_paths"]
            assert len(plan["ring"]) + (plan["coordinator"] not in plan["ring"]) >= 2, plan
            got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=40, draft="ngram", timeout=60)
            assert got["output_token_ids"] == want_greedy[: len(got["output_token_ids"])]
            assert len(got["output_token_ids"]) == 40 or got["finish_reason"] == "eos"
            for key in ("version", "model", "peers", "coordinator", "ring", "rtt_ms", "prompt_token_ids",
                        "output_sha256", "tokens_per_s", "traversal_ms", "accepted_per_traversal", "replans"):
                assert key in got, key
            blocks = sorted(tuple(p["block"]) for p in got["peers"] if p["block"])
            assert blocks[0][0] == 0 and blocks[-1][1] == 6
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
            # every member's RTT comes from a probe of the path hops take, sub-millisecond on loopback
            info = await _until_probed(h, peer, set(plan["ring"]) | {plan["coordinator"]})
            assert all(v["rtt_ms"] < 50 for v in info.values()), info
            sampled = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=24, temperature=0.8,
                                            top_p=0.9, seed=7, draft="none", timeout=60)
            assert sampled["output_token_ids"] == want_sampled[: len(sampled["output_token_ids"])]
        assert all(swarm.alive()), [swarm.log(i)[-2000:] for i in range(3)]


async def _until_probed(h, peer: str, members: set[str], timeout: float = 15.0) -> dict:  # type: ignore[no-untyped-def]
    """The asked peer's view of the others once each RTT comes from a probe (swarm/node/members/probe.py)."""
    with trio.fail_after(timeout):
        while True:
            st = await client.status(h, peer)
            info = {p: v for p, v in st["peer_info"].items() if p in members and p != st["peer_id"]}
            if info and all(v["rtt_from"] == "probe" for v in info.values()):
                return info
            await trio.sleep(0.5)


async def test_ring_receipt_and_run_json_agree_in_bf16(ckpt: Path) -> None:
    """Anyone can check a swarm against one box: `shard-swarm run --json` with the receipt's
    settings gives the same tokens, in bf16 with drafted chunks in flight."""
    import json
    import subprocess
    import sys

    with start_local_swarm(3, ckpt, dtype="bf16") as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            await client.wait_ready(h, peer, timeout=90)
            receipt = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=48, draft="ngram", timeout=60)
    depth = receipt["draft"]["max_depth"]
    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "run", "--model", str(ckpt), "--stages", "2", "--dtype", "bf16",
         "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "48", "--draft", "ngram",
         "--depth", str(depth), "--threads", "1", "--json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    local = json.loads(out.stdout)
    assert local["output_token_ids"] == receipt["output_token_ids"]
    assert local["output_sha256"] == receipt["output_sha256"]


async def test_wan_ring_through_delaying_proxies(ckpt: Path) -> None:
    """Every hop through a 15 ms one-way delaying proxy (no tc netem here): the ring still gives
    one box's tokens, and each traversal costs at least the hops' delay."""
    delay_ms = 15.0
    want = _reference(ckpt, max_new_tokens=24, drafter=NgramDrafter(), policy=KPolicy(max_depth=2))
    with start_local_swarm(3, ckpt, dtype="fp32", delay_ms=delay_ms) as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=120)
            got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=24, draft="ngram", timeout=90)
    plan = st["plan"]
    path = [plan["coordinator"], *plan["ring"], plan["coordinator"]]
    network_hops = sum(1 for a, b in zip(path, path[1:], strict=False) if a != b)
    assert network_hops >= 2
    assert got["output_token_ids"] == want[: len(got["output_token_ids"])]
    assert got["traversal_ms"] >= network_hops * delay_ms * 0.95, (got["traversal_ms"], network_hops)
    # the measured RTTs the planner used include the proxies' delay too
    rtts = [v for row in got["rtt_ms"].values() for v in row.values()]
    assert rtts and min(rtts) >= 2 * delay_ms * 0.9, rtts
