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
        # the receipt names how each stage ran: compiled, span 64, eager from 64 (the context is 512)
        ran = {p["id"]: p["compiled"] for p in got["peers"] if p["block"]}
        assert ran and all(r == {"spans": [64], "eager_from": 64, "eager": None, "dtype": "fp32"} for r in ran.values()), ran
        assert got["replay_note"] is None  # fp32 compiled stages give eager's tokens: an exact reference
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


def test_warm_within_compiles_spans_while_the_next_fits_before_the_deadline(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiling node's warm-up is bounded by the leader's load wait (runtime.warm_within): each
    next span is compiled only if, taking as long as the slowest so far, it ends by the deadline;
    the first always; the spans left out run eagerly (the step's longest is lowered)."""
    import swarm.model.compiled as compiled
    from swarm.model.weights import open_checkpoint
    from swarm.node.compute.runtime import warm_within

    now = [0.0]
    calls: list[int | None] = []

    def fake_warm(stage: Stage, spans: int | None = None) -> list[int]:  # 10 s a call, no real compile
        calls.append(spans)
        now[0] += 10.0
        return [64, 128, 256][: spans or 3]

    monkeypatch.setattr(compiled, "warm_compiled", fake_warm)
    ck = open_checkpoint(ckpt)
    for deadline, want in ((1000.0, [64, 128, 256]), (25.0, [64, 128]), (-1.0, [64])):
        stage = Stage.load(ck.args, ck.source, 0, 2, dtype=torch.float32)
        stage.enable_compiled(256)  # the model's positions: spans 64, 128, 256
        now[0], calls[:] = 0.0, []
        assert warm_within(stage, deadline, clock=lambda: now[0]) == want
        assert stage.compiled is not None and stage.compiled.longest == want[-1] and calls == list(range(1, len(want) + 1))


async def test_a_second_ask_for_a_block_while_it_compiles_waits_for_the_compile(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-plan's plan may ask for the block whose compile the first plan's ask is still running
    (the leader's wait ran out): the second ask must answer only once the graphs exist, or the ring
    serves with its first tokens queued behind the compile (runtime.Models.stage)."""
    import time

    import swarm.model.compiled as compiled
    from swarm.node.compute.runtime import Compute, Models
    from swarm.node.notices import Hooks, Notices
    from swarm.node.settings import NodeSettings

    said: list[str] = []

    def slow_warm(stage: Stage, spans: int | None = None) -> list[int]:  # in the compute thread
        time.sleep(0.5)
        said.append("warmed")
        return [64]

    monkeypatch.setattr(compiled, "warm_compiled", slow_warm)
    settings = NodeSettings(seed=b"s" * 32, swarm_id="x" * 32, secret=b"k" * 32, model_dir=ckpt, dtype=torch.float32,
                            compile=True, compile_span=64)  # fmt: skip
    models = Models(settings, Compute(), Notices(Hooks()))

    async def first() -> None:
        await models.stage(0, 2)
        said.append("first")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        with trio.fail_after(30):
            while (0, 2) not in models._stages:  # loaded: its compile runs now
                await trio.sleep(0.01)
        await models.stage(0, 2)
        said.append("second")
    assert said.index("warmed") < said.index("second"), said
    assert models.compiled is not None and models.compiled["spans"] == [64]


@pytest.mark.slow  # compiles (or loads from inductor's cache) the stages' first graph
async def test_a_node_short_of_time_compiles_fewer_spans_and_serves_the_rest_eagerly(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """With no time left of its share of the leader's load wait (COMPILE_SHARE 0 here), a compiling
    node compiles its first span only and answers: its status and the receipt say the steps from
    position 64 run eagerly, the fp32 tokens past 64 equal one box's, and no graph is compiled
    while serving."""
    from swarm.node.compute import runtime

    monkeypatch.setattr(runtime, "COMPILE_SHARE", 0.0)
    want = _reference(ckpt, PROMPT, 80)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[2, 2],
                         overrides={i: {"compile": True, "compile_span": 128} for i in (0, 1)})  # fmt: skip
        await swarm.start_all()
        await swarm.ready(timeout=600)
        before = int(counters["stats"]["unique_graphs"])
        for i, p in swarm.peers.items():
            if p.epoch.stage is not None:
                status = p.serving.reporter.status()["compiled"]
                assert status["spans"] == [64] and status["eager_from"] == 64, status
                assert "1 longer span(s) left eager" in swarm.logs(i)
                assert "'event': 'compiled', 'layers': [0, 2], 'spans': [64], 'eager_from': 64" in swarm.logs(i) or \
                    "'event': 'compiled', 'layers': [2, 4], 'spans': [64], 'eager_from': 64" in swarm.logs(i)  # join --json
        got = await swarm.generate(1, PROMPT, 80, draft="none")
        assert got["output_token_ids"] == want
        assert all(p["compiled"]["eager_from"] == 64 for p in got["peers"] if p["block"]), got["peers"]
        assert int(counters["stats"]["unique_graphs"]) == before
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("dtype", "compiled"), [pytest.param(torch.float32, True, marks=pytest.mark.slow),  # one graph: ~8 s cold
                                                 (torch.float16, False)])
async def test_a_compiled_node_measures_the_speed_it_advertises_through_its_compiled_step(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, compiled: bool
) -> None:
    """The planner splits blocks by the ms per layer a node advertises (Models.measure): a --compile
    node times its probe layer's one-token steps through the compiled step it will serve with (one
    graph of one layer), not eagerly; one whose layers cannot compile (fp16 here) times them eagerly."""
    from swarm.node.compute.runtime import Compute, Models
    from swarm.node.notices import Hooks, Notices
    from swarm.node.settings import NodeSettings

    torch.set_num_threads(1)
    seen = _counting(monkeypatch)
    settings = NodeSettings(seed=b"s" * 32, swarm_id="x" * 32, secret=b"k" * 32, model_dir=ckpt, dtype=dtype, compile=True)
    ms = await Models(settings, Compute(threads=False), Notices(Hooks())).measure()
    assert ms > 0
    # the warm-up step, then 15 timed ones (warm_compiled's own step besides, when it compiled)
    timed = seen["compiled"] - 1 if compiled else seen["eager one-token"]
    assert timed == 16 and seen["eager one-token" if compiled else "compiled"] == 0, seen


async def test_a_stage_that_cannot_compile_serves_eagerly_and_says_why_once(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """--compile on a swarm whose invite holds the KV cache as int8 (compiled.unsupported): the
    node does not fail, its stage serves eagerly with the same tokens as one box of that format,
    and it says why once, in a notice, in its status and in the receipt; a node started without
    --compile says nothing of it (its receipt entry null)."""
    torch.set_num_threads(1)
    model = LocalModel.load(ckpt, stages=1, dtype=torch.float32, kv_cache="int8")
    want = generate(model, PROMPT, eos_token_ids=(), max_new_tokens=20).output_token_ids
    seen = _counting(monkeypatch)
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(), ckpt, nursery, layers=[2, 2],
                         overrides={0: {"compile": True, "kv_cache": "int8"}, 1: {"kv_cache": "int8"}})  # fmt: skip
        await swarm.start_all()
        await swarm.ready()
        got = await swarm.generate(1, PROMPT, 20, draft="none")
        assert got["output_token_ids"] == want and seen["compiled"] == 0 and seen["eager one-token"] > 0
        ran = {p["id"]: p["compiled"] for p in got["peers"]}
        for i, p in swarm.peers.items():
            if p.epoch.stage is None:
                continue
            assert p.epoch.stage.compiled is None
            status = p.serving.reporter.status()["compiled"]
            if i == 1:  # not asked: status and receipt say nothing of compiling (an older node reads no such field)
                assert status is None and ran[p.peer_id] is None and "--compile:" not in swarm.logs(i)
                continue
            why = ran[p.peer_id]["eager"]
            assert ran[p.peer_id]["spans"] == [] and ran[p.peer_id]["dtype"] == "fp32", ran
            assert status["spans"] == [] and "int8 KV cache" in status["eager"] and why == status["eager"], status
            assert swarm.logs(i).count("--compile:") == 1 and "serving eagerly" in swarm.logs(i)
            assert "'event': 'compiled'" in swarm.logs(i) and "'spans': [], 'eager_from': 0, 'eager': " in swarm.logs(i)
        nursery.cancel_scope.cancel()
