"""--memory is a peer's whole budget (planner/budget.py), proved by the kernel: each node process
of a local swarm serving the bundled model runs inside a memory cgroup whose limit is exactly
what that node offered (launch.sized_offers: its planned part, the KV of the 8 sessions each stage
reserves, plus its runtime overhead). Each node's own VmHWM is held to its offer too: the cgroup
charges a page to whoever touched it first, so torch's shared libraries, already in the page
cache, are not in its figure, while VmHWM counts them, as one peer per machine pays them; and
VmHWM would count a checkpoint's pages mapped while a block loads (weights.py reads them instead).

Proved here: eight sessions at once in fp32; an int4 load from bf16 safetensors and from the
bundled Q4_1 GGUF; a re-plan that moves blocks (a stage killed, the survivors grow into its
layers, each releasing its old block before it loads the new one). No node is killed, every
output equals one process's at the same quantization. Skipped, naming why, where no memory
cgroup can be made (not root, no writable cgroup v1 memory controller or v2 delegation)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm import client
from swarm.launch import LocalSwarm, offer_for, sized_offers, start_local_swarm
from swarm.model.bundled import bundled_gguf_path, default_model_dir
from swarm.model.generate import LocalModel, generate
from swarm.model.speculative import DEFAULT_PREFILL_WINDOW
from swarm.model.tokenizer import Tokenizer
from swarm.testing.memlimit import MemoryCgroup, memlimit_unavailable_reason, memory_cgroup

_reason = memlimit_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_reason is not None, reason=f"no memory limit: {_reason}")]  # fmt: skip
CONTEXT = 512
QUESTIONS = ["Name three colours of the sea.", "What is two plus two?", "Say hello in French.",
             "Why is the sky blue?", "Name a prime number.", "What do bees make?", "Count to five.",
             "What is the capital of Italy?"]  # fmt: skip
NEW = [12, 8, 10, 14, 6, 9, 11, 7]


def _prompts(n: int = len(QUESTIONS)) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir())
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS[:n]]


def _one_box(source: Path, prompts: list[list[int]], quant: str = "none") -> list[list[int]]:
    torch.set_num_threads(1)
    model = LocalModel.load(source, stages=1, dtype=torch.float32, quant=quant)
    return [generate(model, p, max_new_tokens=n).output_token_ids for p, n in zip(prompts, NEW, strict=False)]


@contextlib.contextmanager
def _swarm_inside_offers(n: int, model: Path, context: int = CONTEXT,
                         **kwargs: Any) -> Iterator[tuple[LocalSwarm, list[int], list[MemoryCgroup]]]:  # fmt: skip
    """A local fp32 swarm of ``n`` nodes (launch.start_local_swarm's ``kwargs``), each node process
    in a cgroup limited to the memory it offers; (swarm, offers, cgroups). The swarm stops before
    the cgroups go (a cgroup is removed only once its processes have)."""
    with start_local_swarm(n, model, dtype="fp32", draft="none", context_tokens=context, **kwargs) as swarm:
        offers = [json.loads((swarm.workdir / f"node{i}.json").read_text())["memory_bytes"] for i in range(n)]
        with contextlib.ExitStack() as stack:
            cgroups = [stack.enter_context(memory_cgroup(offer)) for offer in offers]
            for cg, proc in zip(cgroups, swarm.procs, strict=True):
                cg.add(proc.pid)  # at once: before it has imported torch
            try:
                yield swarm, offers, cgroups
            finally:
                swarm.stop()


async def _generate(swarm: LocalSwarm, node: int, prompts: list[list[int]], new: list[int] = NEW) -> list[dict[str, Any]]:
    """Every prompt at once (new[i] tokens each) through ``node``, once the ring serves."""
    got: list[dict[str, Any]] = [{} for _ in prompts]
    async with client.open_client(swarm.addrs[node], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
        await client.wait_ready(h, peer, timeout=300)

        async def one(i: int) -> None:
            got[i] = await client.generate(h, peer, prompt_ids=prompts[i], max_new_tokens=new[i], draft="none",
                                           timeout=600)  # fmt: skip

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return got


async def _own_memory(swarm: LocalSwarm, nodes: list[int]) -> dict[int, dict[str, Any]]:
    """Each node's own status memory: VmHWM (``measured_peak_bytes``), predicted, offered."""
    out = {}
    for i in nodes:
        async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            out[i] = (await client.status(h, peer))["memory"]
    return out


def _assert_inside(swarm: LocalSwarm, cgroups: list[MemoryCgroup], offers: list[int],
                   hwm: dict[int, dict[str, Any]]) -> str:
    """No node killed by the kernel, each listed one alive and its VmHWM within its offer or, where
    it is over, within the issue's 1.05 of its predicted peak; the figures. (VmHWM counts shared
    libraries' pages, which other processes on the machine fault in: a clean-clone CI run measured
    +80 MB on each of the head-only test's three nodes after the compile tests had run beside it,
    the cgroups' own peaks unchanged, so the coordinator's 0.1 layer of slack read 1.029.)"""
    def ratio(m: dict[str, Any]) -> str:  # a standby predicts nothing
        return f"{m['measured_peak_bytes'] / m['predicted_peak_bytes']:.3f}" if m.get("predicted_peak_bytes") else "-"

    figures = {i: f"VmHWM {m['measured_peak_bytes'] / 1e6:.0f} of {offers[i] / 1e6:.0f} MB offered "
                  f"({ratio(m)} of predicted), cgroup peak {cgroups[i].peak_bytes() / 1e6:.0f}"
               for i, m in hwm.items()}  # fmt: skip
    assert all(cg.oom_kills() == 0 for cg in cgroups), (figures, swarm.log(0)[-2000:])
    assert all(swarm.alive()[i] for i in hwm), (figures, [swarm.log(i)[-2000:] for i in hwm])
    assert all(m["measured_peak_bytes"] <= max(offers[i], 1.05 * (m.get("predicted_peak_bytes") or 0))
               for i, m in hwm.items()), figures
    return str(figures)


async def test_nodes_inside_a_memory_limit_of_their_offer_serve_eight_sessions_as_one_box() -> None:
    prompts = _prompts()
    want = _one_box(default_model_dir(), prompts)
    with _swarm_inside_offers(3, default_model_dir()) as (swarm, offers, cgroups):
        got = await _generate(swarm, 0, prompts)
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.status(h, peer, coordinator=True)
        hwm = await _own_memory(swarm, [0, 1, 2])
        print("eight sessions:", _assert_inside(swarm, cgroups, offers, hwm))
    assert st["capacity"]["sessions"] >= 8, st["capacity"]  # the ring holds them all at once
    assert [r["output_token_ids"] for r in got] == want


async def test_long_prompts_at_once_keep_the_first_stage_queue_to_their_windows() -> None:
    """Three 1,200-token prompts (19 pieces each) at once: the coordinator sends each a window of
    pieces at a time (coordinator.py), so the first stage, which takes one piece per session per
    forward, never queues more than the three windows (and their SESSION_ENDs), where it used to
    queue nearly every piece; every node stays inside its offer (which counts those windows:
    ModelSpec.inflight_bytes) and the answers equal one box's."""
    prompt = [1] + [(i * 7919) % 40000 + 100 for i in range(1199)]
    want = _one_box(default_model_dir(), [prompt])[0][:2]
    with _swarm_inside_offers(3, default_model_dir(), context=1280) as (swarm, offers, cgroups):
        got = await _generate(swarm, 0, [prompt] * 3, new=[2] * 3)
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            blocks = (await client.status(h, peer, coordinator=True))["plan"]["blocks"]
        first = swarm.peer_ids.index(next(p for p, (s, e) in blocks.items() if s == 0 and e > 0))
        async with client.open_client(swarm.addrs[first], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            stage = (await client.status(h, peer))["stage"]
        hwm = await _own_memory(swarm, [0, 1, 2])
        print("three long prompts:", stage["max_queued"], "queued at most;", _assert_inside(swarm, cgroups, offers, hwm))
    assert [r["output_token_ids"] for r in got] == [want] * 3
    assert stage["chunks"] >= 3 * 19 and 1 <= stage["max_queued"] <= 3 * (DEFAULT_PREFILL_WINDOW + 1), stage


async def test_a_head_only_coordinator_admits_what_its_offer_holds_of_eight_long_prompts() -> None:
    """A coordinator holding no layer still takes every piece of every prompt from the tail and runs
    the head on each session's chunks: the budget counts both per session (ModelSpec.head_session_bytes),
    so its offer, sized for the head and 8 sessions, bounds the ring at 8 although each stage holds 9.
    Eight 600-token prompts (10 pieces each, over the window) at once: all admitted, every node inside
    its offer, none killed, the answers one box's."""
    model, context = default_model_dir(), 768
    head = offer_for(model, 0.1, context_tokens=context, coordinator=True)  # no room for a layer
    stage = offer_for(model, 15.9, context_tokens=context, coordinator=False)  # half the layers, a 9th session
    prompts = [[1] + [(i * 7919 + 131 * k) % 40000 + 100 for i in range(599)] for k in range(8)]
    want = _one_box(model, prompts[:2])
    with _swarm_inside_offers(3, model, context=context, memory_bytes=[head, stage, stage]) as (swarm, offers, cgroups):
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            plan = (await client.wait_ready(h, peer, timeout=300))["plan"]
            capacity = (await client.status(h, peer, coordinator=True))["capacity"]
        got = await _generate(swarm, 0, prompts)
        hwm = await _own_memory(swarm, [0, 1, 2])
        print("head-only coordinator:", capacity, _assert_inside(swarm, cgroups, offers, hwm))
    assert plan["coordinator"] == swarm.peer_ids[0] and swarm.peer_ids[0] not in plan["blocks"], plan
    assert capacity["sessions"] == 8, capacity  # the coordinator's 8, not the stages' 9
    assert [r["output_token_ids"] for r in got[:2]] == want


@pytest.mark.parametrize("source", ["bf16 safetensors", "Q4_1 GGUF"])
async def test_an_int4_swarm_loads_inside_its_offers_and_serves_as_one_box(source: str) -> None:
    """int4 from a float checkpoint quantizes one layer at a time (only that layer's float
    temporaries beside the compact rest, counted as the load-time peak); from Q4 blocks it
    repacks them without a float copy. Either way the node keeps only the compact block."""
    path = default_model_dir() if source == "bf16 safetensors" else bundled_gguf_path()
    prompts = _prompts(4)
    want = _one_box(path, prompts, quant="int4")
    with _swarm_inside_offers(3, path, quant="int4") as (swarm, offers, cgroups):
        got = await _generate(swarm, 0, prompts)
        hwm = await _own_memory(swarm, [0, 1, 2])
        print(f"int4 from {source}:", _assert_inside(swarm, cgroups, offers, hwm))
    assert [r["output_token_ids"] for r in got] == want


async def test_a_replan_that_moves_blocks_keeps_the_survivors_inside_their_offers() -> None:
    """Three nodes each offering enough for half the model; a stage is killed and the survivors
    take over its layers. Which ones depends on the first plan, which the planner may make with
    or without a standby: seen both [0, 10) growing to [0, 15) while the head-only coordinator
    loads [15, 30), and a standby loading the lost [10, 30). A survivor whose block changes frees
    its old block before it loads the new one (Models.stage) and keeps no page of the checkpoint
    (weights.py); its VmHWM, over its whole life, stays inside its offer."""
    model = default_model_dir()
    prompts = _prompts(4)
    want = _one_box(model, prompts)
    offer = sized_offers(2, model, ["fp32"], device="cpu", context_tokens=CONTEXT, draft="none")[0]
    with _swarm_inside_offers(3, model, memory_bytes=[offer] * 3) as (swarm, offers, cgroups):
        before = await _generate(swarm, 0, prompts[:1])
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            first = await client.status(h, peer, coordinator=True)
        plan = first["plan"]
        victim = next(swarm.peer_ids.index(p) for p in reversed(plan["ring"]) if p != plan["coordinator"])
        survivors = [i for i in range(3) if i != victim]
        swarm.kill(victim)
        node = swarm.peer_ids.index(plan["coordinator"])
        async with client.open_client(swarm.addrs[node], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            with trio.fail_after(300):
                while (st := await client.status(h, peer, coordinator=True)).get("epoch") == first["epoch"] or not st.get("serving"):
                    await trio.sleep(0.25)
        got = await _generate(swarm, node, prompts)
        hwm = await _own_memory(swarm, survivors)
        print("re-plan:", plan["blocks"], "->", st["plan"]["blocks"], _assert_inside(swarm, cgroups, offers, hwm))
    moved = [i for i in survivors if st["plan"]["blocks"].get(swarm.peer_ids[i]) != plan["blocks"].get(swarm.peer_ids[i])]
    assert moved, (plan["blocks"], st["plan"]["blocks"])  # a survivor loaded a new block
    assert before[0]["output_token_ids"] == want[0]
    assert [r["output_token_ids"] for r in got] == want
