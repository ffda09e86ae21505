"""A node's stage with ``join --compile`` (NodeSettings.compile), in an in-memory swarm: the stage
is compiled before the ring serves, a lone session's one-token decode steps and drafted verify
chunks go through the compiled graphs while prefill and batches of sessions keep the eager path,
fp32 tokens equal one box's, and the graphs stay within their bound whatever lengths, drafts and
batch sizes come (model/compiled.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch._dynamo.utils import counters

from swarm.model.compiled import CompiledStep
from swarm.model.generate import LocalModel, generate
from swarm.model.stage import Stage
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemNet
from swarm.testing.memswarm import MemSwarm

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=4, row_gain_spread=1.0), seed=5)


def _reference(ckpt: Path, prompt: list[int], n: int, **kw: Any) -> list[int]:
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32)
    return generate(model, prompt, eos_token_ids=(), max_new_tokens=n, **kw).output_token_ids


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts of a stage's compiled steps and eager passes by kind (a pass's rows and sessions)."""
    seen: Counter[str] = Counter()
    step, walk = CompiledStep.step, Stage._walk

    def counted_step(self: CompiledStep, cache: Any, h: torch.Tensor) -> torch.Tensor:
        seen["compiled" if h.shape[0] == 1 else "compiled chunk"] += 1
        return step(self, cache, h)

    def counted_walk(self: Stage, units: list[list[Any]]) -> list[torch.Tensor]:
        chunks = [c for unit in units for c in unit]
        rows = sum(h.shape[0] for _, _, h in chunks)
        seen["eager one-token" if rows == 1 else "eager batch" if len(chunks) > 1 else "eager chunk"] += 1
        return walk(self, units)

    monkeypatch.setattr(CompiledStep, "step", counted_step)
    monkeypatch.setattr(Stage, "_walk", counted_walk)
    return seen


@pytest.mark.slow  # a cold inductor cache compiles for ~10 s a graph of this model
async def test_a_compiled_node_steps_lone_sessions_compiled_and_batches_eagerly(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    want = _reference(ckpt, PROMPT, 30)
    seen = _counting(monkeypatch)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[2, 2],
                         overrides={i: {"compile": True, "compile_span": 64} for i in (0, 1)})  # fmt: skip
        await swarm.start_all()
        await swarm.ready(timeout=600)
        stages = [p.epoch.stage for p in swarm.peers.values() if p.epoch.stage is not None]
        assert stages and all(st.compiled is not None for st in stages)
        # warmed before serving: one graph each (span 64), no user token paid for it
        status = [p.serving.reporter.status()["compiled"] for p in swarm.peers.values() if p.epoch.stage is not None]
        assert all(s["spans"] == [64] and s["capacity"] == min(512, swarm.args.max_seq_len) and s["eager"] is None for s in status), status
        warmed = seen["compiled"]
        seen.clear()
        got = await swarm.generate(1, PROMPT, 30, draft="none")
        assert got["output_token_ids"] == want
        # the 11-token prompt is one eager chunk per stage; then 29 one-token steps per stage compiled
        # (the last token is sampled from the 30th step's logits: no stage sees it)
        assert seen["eager chunk"] == len(stages) and seen["compiled"] == 29 * len(stages), (seen, warmed)
        assert seen["eager one-token"] == 0 and seen["eager batch"] == 0, seen
        # two sessions at once: their steps share eager passes (model/batched.py), tokens unchanged
        seen.clear()
        two = [PROMPT, PROMPT[::-1]]
        want2 = [want, _reference(ckpt, two[1], 30)]
        got2: list[list[int]] = [[], []]

        async def one(k: int) -> None:
            got2[k] = (await swarm.generate(1, two[k], 30, draft="none"))["output_token_ids"]

        async with trio.open_nursery() as pair:
            for k in (0, 1):
                pair.start_soon(one, k)
        assert got2 == want2
        assert seen["eager batch"] > 0, seen
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_compiled_nodes_graphs_stay_within_their_bound(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """Sessions of several lengths (across spans and past the longest compiled span), drafted
    verify chunks (compiled, padded to a compiled row count) and rollbacks, batches of 1 to 3
    sessions: no graph is compiled while serving (all of them, one per span and row count,
    1 + log2(longest / 64) spans, were compiled before the ring served)."""
    jobs = [(PROMPT, 20), (PROMPT * 6, 40), (PROMPT[:3], 150), (PROMPT * 2, 90)]
    want = [_reference(ckpt, p, n) for p, n in jobs]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[2, 2],
                         overrides={i: {"compile": True, "compile_span": 128} for i in (0, 1)})  # fmt: skip
        await swarm.start_all()
        await swarm.ready(timeout=600)
        steps = [p.epoch.stage.compiled for p in swarm.peers.values() if p.epoch.stage is not None]
        assert steps and all(s is not None and s.longest == 128 and s.compiled_spans == {64, 128} for s in steps)
        before = int(counters["stats"]["unique_graphs"])
        seen = _counting(monkeypatch)
        got: list[list[int]] = [[] for _ in jobs]

        async def one(k: int, draft: str) -> None:
            p, n = jobs[k]
            got[k] = (await swarm.generate(1, p, n, draft=draft))["output_token_ids"]

        for draft in ("none", "ngram"):
            await one(0, draft)  # alone
            async with trio.open_nursery() as batch:  # three at once, then the long one alone past 128
                for k in (1, 2, 3):
                    batch.start_soon(one, k, draft)
            assert got == want, draft
        # every graph was compiled before the ring served: none while serving
        assert int(counters["stats"]["unique_graphs"]) == before
        assert all(s is not None and s.compiled_spans == {64, 128} for s in steps)  # and none longer
        assert seen["compiled chunk"] > 0, seen  # the ngram drafter's verify chunks went compiled
        nursery.cancel_scope.cancel()


async def test_a_stage_that_cannot_compile_serves_eagerly_and_says_why_once(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """--compile on a swarm whose invite holds the KV cache as int8 (compiled.unsupported): the
    node does not fail, its stage serves eagerly with the same tokens as one box of that format,
    and it says why once, in a notice and in its status."""
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32, kv_cache="int8")
    want = generate(model, PROMPT, eos_token_ids=(), max_new_tokens=20).output_token_ids
    seen = _counting(monkeypatch)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[2, 2],
                         overrides={i: {"compile": True, "kv_cache": "int8"} for i in (0, 1)})  # fmt: skip
        await swarm.start_all()
        await swarm.ready()
        got = await swarm.generate(1, PROMPT, 20, draft="none")
        assert got["output_token_ids"] == want and seen["compiled"] == 0 and seen["eager one-token"] > 0
        for i, p in swarm.peers.items():
            if p.epoch.stage is None:
                continue
            assert p.epoch.stage.compiled is None
            status = p.serving.reporter.status()["compiled"]
            assert status["spans"] == [] and "int8 KV cache" in status["eager"], status
            assert swarm.logs(i).count("--compile:") == 1 and "serving eagerly" in swarm.logs(i)
        nursery.cancel_scope.cancel()
