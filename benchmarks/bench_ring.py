"""The ring end to end on the bundled model, side by side: LAN ring vs one process, WAN drafting.

    .venv/bin/python benchmarks/bench_ring.py [--quick] [--runs N] [--wan-runs N]
        [--only lan|lan-auto|wan] [--drafts int4,int8,self] [--keep] [--ab TREE] [--compiled]

Real node processes (swarm/launch.py) on loopback, a real client (swarm/client.py),
greedy decoding, bf16, ``--threads`` (default 1) torch threads in EVERY process.

LAN  3 peers on loopback, ``draft="none"`` (one token per traversal), decode tok/s of the ring
     divided by decode tok/s of the same model in one process (``LocalModel``, 1 stage, same
     dtype, same threads, run in a worker thread of this process while the ring sits idle).
     Why threads=1 everywhere: without drafting only one stage computes at a time, so the ring
     never uses more than one core for compute; giving the single process 1 thread too compares
     the same compute resource, and keeps 3 processes from oversubscribing 2 cores (REFERENCE.md:
     2 threads while another process held a core went 16 ms -> 468 ms per token). Target >= 0.85.
     Beside it, the same blocks as plain processes on pipes with no swarm code
     (pipeline_floor.py): ``floor_vs_local`` is what this machine allows a ring of those blocks
     (a forward after its process sat idle runs slower than back to back), ``ring_vs_floor``
     what our software costs on top.
     ``--compiled``: beside them in every round, a ring of compiled nodes (``join --compile``:
     launch.py ``compile``, spans 64 and 128, which the prompt and its tokens fit in) and one
     compiled process (the same capacity and spans): ``lan.compiled`` holds compiled ring ÷
     eager ring, compiled ring ÷ compiled process, and each ÷ the eager process, paired per round.
LAN-AUTO  3 peers on loopback that hold ``auto``'s draft model (an int4 copy of the model):
     chat requests with ``draft="auto"`` against ``draft="none"``, interleaved; the coordinator
     decides per request by measured cost (swarm/node/compute/drafting.py) and says so in the receipt.
     Target: auto >= 0.98 of none (drafting never makes a LAN slower).
WAN  4 peers behind a delaying proxy (``delay_ms`` one way per hop, default 25). One peer offers
     only the coordinator's memory (embedding + head + the draft model) and three offer 10 layers
     each, so the only plan is a layer-less coordinator and 3 stages: 4 hops, ~100 ms of latency per
     traversal. One swarm per draft model of ``--drafts`` (a node holds one): the chat workload
     (what most users send; the primary row) and the copy workload (repeat a passage given in the
     prompt: prompt lookup's home ground, a second row), each with ``draft="model"`` against
     ``draft="none"`` (one token per traversal) on the same ring, interleaved; the first swarm also
     runs ``draft="ngram"``. Ratios: drafted decode tok/s / none's (target >= 2.5 on chat with the
     best draft), and decode tok/s / the bound ``accepted_per_traversal x chunks in flight /
     traversal`` where chunks in flight is the mean the policy issued (receipt
     ``draft.mean_in_flight``) and traversal the receipt's median send->result time (target >= 0.8).
     Each receipt is replayed in one process with its drafter and policy (``run --receipt``):
     greedy output must be identical.

Every ratio is a median over ``--runs`` runs whose two sides are interleaved (ABAB, BABA...), so
background load on this shared 2-core machine hits both alike; one warm-up run per side is
discarded. Writes benchmarks/results/ring.json (with ``--only``, only that part of it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline_floor import floor_tok_s  # noqa: E402

from swarm import client  # noqa: E402
from swarm.launch import LocalSwarm, start_local_swarm  # noqa: E402
from swarm.model.bundled import default_model_dir  # noqa: E402
from swarm.model.capability import swarm_head_quant  # noqa: E402
from swarm.model.config import ModelArgs  # noqa: E402
from swarm.model.drafters import NgramDrafter  # noqa: E402
from swarm.model.draftload import load_draft_model, parse_draft  # noqa: E402
from swarm.model.generate import DTYPES, LocalModel, generate  # noqa: E402
from swarm.model.speculative import DEFAULT_PREFILL_CHUNK, KPolicy  # noqa: E402
from swarm.model.tokenizer import Tokenizer  # noqa: E402
from swarm.model.weights import open_checkpoint  # noqa: E402
from swarm.node.compute.drafting import draft_bytes  # noqa: E402
from swarm.node.settings import model_spec  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "ring.json"
READY_TIMEOUT_S = 600.0
LAN_CONTEXT = 1024  # the LAN swarms' context (launch.py's default): the compiled caches' capacity
COMPILE_SPAN = 128  # --compiled: spans 64 and 128 compiled (the chat prompt and its 32 tokens fit)

NOTES = [
    "ring_vs_local is the median of per-pair ratios (ring and local runs interleaved); "
    "ring_vs_local_of_medians and ring_vs_local_best view the same runs: on a shared 2-core "
    "machine a single pair can swing 0.3x-2x, so read all three and the per-run list",
    "where_the_time_goes is measured inside the nodes (timestamps per chunk, medians over "
    "one-token decode chunks); compute + overheads + transport add up to the token cycle",
    "greedy_identical_spec_vs_none can be false in bf16: numerics depend on chunk shapes; "
    "ring_greedy_identical_to_local_spec compares with one process running the same drafter "
    "and policy (same chunk schedule), which must be true",
    "wan rows: spec_vs_bound uses the chunks in flight the policy issued (receipt draft.mean_in_flight), "
    "spec_vs_bound_at_max_depth the ring's maximum depth; spec_in_flight_measured is the time average "
    "(Little's law): where it is below the issued depth, the coordinator was drafting (or the box's "
    "cores were busy) while fewer chunks were in flight",
    "every WAN and LAN process shares this machine's 2 cores (and other engineers' jobs): a draft "
    "model's forwards compete with the stages' for them, which a ring of separate machines would not",
    "lan.ab (--ab TREE): a second 3-node swarm whose nodes run TREE's code, one generation of each ring "
    "and one local run per round in rotating order; ring_vs_base is the median of per-round ratios "
    "(> 1: this tree faster). On a loaded box a stage's 'out (forward -> sent)' includes time its "
    "process was preempted inside the socket write that woke the next stage, so a hop's transport can "
    "be negative: read out + the next hop together",
]

CHAT_PROMPT = "What are three good habits for a beginner learning to cook at home?"
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the weather in a small leather book: wind "
    "from the west, a light swell, three fishing boats returning before dark."
)
COPY_PROMPT = f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}"


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def swarm_cpu_s(swarm: LocalSwarm) -> float:
    pids = [p.pid for p in swarm.procs] + ([swarm.proxy.pid] if swarm.proxy is not None else [])
    return sum(proc_cpu_s(pid) for pid in pids)


# Per-chunk timestamps from inside the node processes, without touching their code: this file is
# written as sitecustomize.py into a directory put on the nodes' PYTHONPATH, so each node wraps a
# few methods at start-up and appends one JSON line per event to ring-trace-<pid>.jsonl.
# time.perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process on the machine.
TRACER = """
import json, os, threading, time

_dir = os.environ.get("RING_BENCH_TRACE")
if _dir:
    _lock = threading.Lock()
    _f = open(os.path.join(_dir, f"ring-trace-{os.getpid()}.jsonl"), "a", buffering=1)

    def _rec(**kw):
        with _lock:
            _f.write(json.dumps(kw) + "\\n")

    try:
        from swarm.model import stage as _st
        from swarm.node.ring import coordinator as _co, stage_worker as _sw
        _rec(k="code", file=_sw.__file__)  # which tree this node runs (--ab checks it)

        _fwd = _st.Stage.forward
        def forward(self, session, h):
            t0 = time.perf_counter()
            out = _fwd(self, session, h)
            self._ring_bench_fwd = (t0, time.perf_counter())
            return out
        _st.Stage.forward = forward

        for _name in ("embed", "logits"):
            def _wrap(orig, name):
                def fn(self, *a, **k):
                    t0 = time.perf_counter()
                    out = orig(self, *a, **k)
                    _rec(k=name, t0=t0, t1=time.perf_counter())
                    return out
                return fn
            setattr(_st.Head, _name, _wrap(getattr(_st.Head, _name), _name))

        # a chunk's arrival is when the reader took it off the link (the worker notes it there);
        # its batch's forward and the results' sends follow in _run_batch
        from swarm.node.ring import gathering as _ga
        _note = _ga.Gatherer.note_arrival
        def _note_traced(self, session):
            self.__dict__.setdefault("_ring_bench_in", {})[session] = time.perf_counter()
            _note(self, session)
        _ga.Gatherer.note_arrival = _note_traced

        _run = _sw.StageWorker._run_batch
        async def _run_traced(self, groups, outbound):  # groups: [[(chunk, h), ...], ...]
            t_run = time.perf_counter()
            self.stage._ring_bench_fwd = (0.0, 0.0)
            await _run(self, groups, outbound)
            try:  # tracing never fails a forward: a changed signature shows as trace_error
                f0, f1 = self.stage._ring_bench_fwd
                t_out = time.perf_counter()
                arrived = self.gathering.__dict__.get("_ring_bench_in", {})
                batch = [c for g in groups for c in g]
                for msg, _h in batch:
                    _rec(k="stage", a=self.stage.start, b=self.stage.end, s=msg.session, c=msg.chunk_id,
                         n=msg.tokens, batch=len(batch), t_in=arrived.get(msg.session, t_run), t_run=t_run,
                         f0=f0, f1=f1, t_out=t_out)
            except Exception as exc:
                _rec(k="trace_error", error=repr(exc))
        _sw.StageWorker._run_batch = _run_traced

        # when a stage's result left (its send returned): the batch's end above comes after the
        # checkpoint that follows each send, where a busy box may deschedule the stage
        from swarm.node.ring import fastlink as _fl
        _flsend = _fl.FrameLink.send
        async def _flsend_traced(self, frame, *a, **k):
            await _flsend(self, frame, *a, **k)
            _rec(k="sent", s=frame.session, c=frame.seq, t=time.perf_counter())
        _fl.FrameLink.send = _flsend_traced

        _send = _co.Coordinator._send
        async def _send_traced(self, chunk, session, *a, **k):  # one chunk (the decode driver's Send)
            t_in = time.perf_counter()
            await _send(self, chunk, session, *a, **k)
            try:  # tracing never fails a send: a changed signature shows as trace_error
                cs = chunk if isinstance(chunk, (list, tuple)) else [chunk]
                _rec(k="send", s=session, c=[c.chunk_id for c in cs], t_in=t_in, t_out=time.perf_counter())
            except Exception as exc:
                _rec(k="trace_error", error=repr(exc))
        _co.Coordinator._send = _send_traced

        _next = _co.Coordinator._next_result
        async def _next_traced(self, chan, session, *a, **k):
            out = await _next(self, chan, session, *a, **k)
            try:
                _rec(k="result", s=session, c=out[0], t=time.perf_counter())
            except Exception as exc:
                _rec(k="trace_error", error=repr(exc))
            return out
        _co.Coordinator._next_result = _next_traced
    except Exception as exc:  # a renamed method: run untraced, say so in the trace
        _rec(k="trace_error", error=repr(exc))
"""


def install_tracer(trace_dir: Path) -> None:
    """Nodes started after this (start_local_swarm copies os.environ) record per-chunk events."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    (trace_dir / "sitecustomize.py").write_text(TRACER)
    os.environ["RING_BENCH_TRACE"] = str(trace_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(trace_dir), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def uninstall_tracer() -> None:
    os.environ.pop("RING_BENCH_TRACE", None)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "trace" not in p
    )


def analyse_trace(trace_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Median ms per one-token decode chunk: each hop's transport, each stage's compute and its
    own overhead (parse, cache, thread hand-off, encode, send), and the coordinator's turn-around
    (result in -> next chunk sent: LM head, decoder, embed, encode, send)."""
    ev: list[dict[str, Any]] = []
    for f in trace_dir.glob("ring-trace-*.jsonl"):
        mine = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        sent = {(e["s"], e["c"]): e["t"] for e in mine if e["k"] == "sent"}
        for e in mine:  # a stage's result is out when its send returned (the tracer's FrameLink.send)
            if e["k"] == "stage" and (e["s"], e["c"]) in sent:
                e["t_out"] = min(e["t_out"], sent[(e["s"], e["c"])])
        ev += mine
    errors = [e["error"] for e in ev if e["k"] == "trace_error"]
    code = sorted({str(Path(e["file"]).parents[3]) for e in ev if e["k"] == "code"})
    stages: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in ev:
        if e["k"] == "stage":
            stages.setdefault((e["s"], e["c"]), []).append(e)
    sends = {(e["s"], c): e for e in ev if e["k"] == "send" for c in e["c"]}
    results = {(e["s"], e["c"]): e["t"] for e in ev if e["k"] == "result"}
    heads = sorted((e for e in ev if e["k"] in ("embed", "logits")), key=lambda e: e["t0"])
    n_stages = len(plan["ring"])
    rows: dict[str, list[float]] = {}

    def put(key: str, seconds: float) -> None:
        rows.setdefault(key, []).append(1000 * seconds)

    for (sess, cid), recs in stages.items():
        nxt = sends.get((sess, cid + 1))
        if (
            len(recs) != n_stages
            or recs[0]["n"] != 1
            or (sess, cid) not in sends
            or (sess, cid) not in results
        ):
            continue  # only one-token decode chunks that went all the way round
        if nxt is None:
            continue
        recs.sort(key=lambda e: e["t_in"])
        t_prev = sends[(sess, cid)]["t_out"]
        for i, r in enumerate(recs):
            put(f"hop{i} transport", r["t_in"] - t_prev)
            put(f"stage{i} [{r['a']},{r['b']}) compute", r["f1"] - r["f0"])
            name = f"stage{i} [{r['a']},{r['b']})"
            put(f"{name} overhead", (r["t_out"] - r["t_in"]) - (r["f1"] - r["f0"]))
            # of which: read -> forward starts (queue, gather, parse, checks, thread hand-off)
            # and forward ends -> sent (encode, hand-off back, send)
            put(f"{name}   in (read -> forward)", r["f0"] - r["t_in"])
            put(f"{name}     read -> batch (hand-off, parse, checks)", r["t_run"] - r["t_in"])
            put(f"{name}   out (forward -> sent)", r["t_out"] - r["f1"])
            t_prev = r["t_out"]
        t_res = results[(sess, cid)]
        put(f"hop{n_stages} transport (tail -> coordinator)", t_res - t_prev)
        turn = [h for h in heads if t_res <= h["t0"] and h["t1"] <= nxt["t_out"]]
        lm = sum(h["t1"] - h["t0"] for h in turn if h["k"] == "logits")
        emb = sum(h["t1"] - h["t0"] for h in turn if h["k"] == "embed")
        put("coordinator LM head", lm)
        put("coordinator embed", emb)
        put("coordinator other (decoder, hand-offs, encode, send)", nxt["t_out"] - t_res - lm - emb)
        logits = [h for h in turn if h["k"] == "logits"]
        if len(logits) == 1:  # of which: result in -> head starts, head ends -> next chunk's _send entered
            put("coordinator   result -> LM head", logits[0]["t0"] - t_res)
            put("coordinator   LM head -> send (decoder, sample)", nxt["t_in"] - logits[0]["t1"])
        put("token cycle (send -> next send)", nxt["t_out"] - sends[(sess, cid)]["t_out"])
    med_rows = {k: round(med(v), 2) for k, v in rows.items()}
    return {
        "chunks_traced": len(rows.get("token cycle (send -> next send)", [])),
        "code": code,  # the source trees the nodes imported swarm from
        "ms_median": med_rows,
        "errors": errors,
    }


def workdir(a: argparse.Namespace, name: str) -> Path:
    """Node configs and logs (node<i>.log, proxy.log) go here; kept for inspection after the run."""
    path = Path(a.workdir) / name
    if path.exists():
        shutil.rmtree(path)
    return path


def git_state(root: Path = ROOT) -> str:
    """The commit measured, and whether the working tree had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "swarm"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (
        " + uncommitted changes in swarm/" if dirty.stdout.strip() else ""
    )


def native_bf16() -> bool:
    """Whether the CPU has bf16 instructions (without them torch's bf16 layers run ~2x slower
    than fp32 here and a K-token verify costs ~3x one token, which shapes every figure below)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def ring_depth(rc: dict[str, Any]) -> int:
    """Chunks the ring allowed in flight for this generation (the receipt's ``draft.max_depth``;
    receipts from before that field used a fixed depth of 2)."""
    draft = rc.get("draft")
    return int(draft["max_depth"]) if isinstance(draft, dict) and "max_depth" in draft else 2


# -- driving a swarm from one trio.run --------------------------------------------------------


async def _with_client(swarm: LocalSwarm, fn: Callable[..., Any]) -> Any:
    async with client.open_client(
        swarm.addrs[-1], secret=swarm.secret, swarm_id=swarm.swarm_id, timeout=READY_TIMEOUT_S
    ) as (host, peer):
        st = await client.wait_ready(host, peer, timeout=READY_TIMEOUT_S)
        return await fn(host, peer, st)


async def _ring_gen(host: Any, peer: str, ids: list[int], new: int, draft: str) -> dict[str, Any]:
    return await client.generate(
        host, peer, prompt_ids=ids, max_new_tokens=new, draft=draft, timeout=120.0
    )


def _slim(rc: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "decode_tokens_per_s",
        "tokens_per_s",
        "traversal_ms",
        "accepted_per_traversal",
        "accepted_per_round",
        "chunks",
        "finish_reason",
    )
    return {k: rc.get(k) for k in keys} | {"new_tokens": len(rc["output_token_ids"])}


# -- LAN ------------------------------------------------------------------------------------------


def bench_lan(model_dir: Path, tok: Tokenizer, a: argparse.Namespace) -> dict[str, Any]:
    ids = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True
        )
    )
    # the ring's coordinator holds the head as a swarm of this quant does (capability.swarm_head_quant)
    head_quant = swarm_head_quant(a.quant, open_checkpoint(model_dir).args.head_stored, torch.device("cpu"), DTYPES[a.dtype])
    local = LocalModel.load(model_dir, stages=1, dtype=DTYPES[a.dtype], quant=a.quant, head_quant=head_quant)
    ring_runs: list[dict[str, Any]] = []
    local_runs: list[dict[str, Any]] = []
    outputs: dict[str, list[int]] = {}
    local_c: LocalModel | None = None
    compiled_runs: list[dict[str, Any]] = []
    local_c_runs: list[dict[str, Any]] = []
    warm_local_s = 0.0
    if a.compiled:  # one process compiled as the ring's nodes are: the same capacity and spans
        from swarm.model.compiled import warm_compiled

        local_c = LocalModel.load(model_dir, stages=1, dtype=DTYPES[a.dtype], quant=a.quant, head_quant=head_quant)
        t0 = time.perf_counter()
        for st in local_c.stages:
            st.enable_compiled(LAN_CONTEXT, COMPILE_SPAN)
            warm_compiled(st)
        warm_local_s = time.perf_counter() - t0

    def run_local(model: LocalModel = local, side: str = "local") -> dict[str, Any]:
        c0 = time.thread_time()  # torch with 1 thread computes in the calling thread
        res = generate(model, ids, max_new_tokens=a.lan_new_tokens)
        cpu = time.thread_time() - c0
        outputs[side] = res.output_token_ids
        return {
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "tokens_per_s": res.tokens_per_s,
            "new_tokens": len(res.output_token_ids),
            "cpu_ms_per_token": 1000 * cpu / len(res.output_token_ids),
        }

    base_runs: list[dict[str, Any]] = []
    base_plan: dict[str, Any] = {}

    async def ring_run(sw: LocalSwarm, host: Any, peer: str, side: str, runs: list[dict[str, Any]]) -> None:
        c0 = swarm_cpu_s(sw)
        rc = await _ring_gen(host, peer, ids, a.lan_new_tokens, "none")
        cpu = swarm_cpu_s(sw) - c0
        outputs[side] = rc["output_token_ids"]
        runs.append(_slim(rc) | {"cpu_ms_per_token": 1000 * cpu / len(rc["output_token_ids"])})

    async def body(host: Any, peer: str, st: dict[str, Any]) -> dict[str, Any]:
        plan = st["plan"]
        async with contextlib.AsyncExitStack() as stack:
            sides: tuple[str, ...] = ("ring", "local")
            if swarm_b is not None:  # --ab: the same ring running the code at a.ab, in every round
                host_b, peer_b = await stack.enter_async_context(client.open_client(
                    swarm_b.addrs[-1], secret=swarm_b.secret, swarm_id=swarm_b.swarm_id, timeout=READY_TIMEOUT_S))
                st_b = await client.wait_ready(host_b, peer_b, timeout=READY_TIMEOUT_S)
                # the planner splits by measured speed, so the blocks may differ (13/17 or 17/13 layers):
                # one session's token crosses every layer either way; the JSON keeps both plans
                base_plan.update(st_b["plan"])
                sides = ("ring", "base", "local")
                await _ring_gen(host_b, peer_b, ids, a.lan_new_tokens, "none")  # warm-up
            if swarm_c is not None:  # --compiled: a ring of compiled nodes and one compiled process
                host_c, peer_c = await stack.enter_async_context(client.open_client(
                    swarm_c.addrs[-1], secret=swarm_c.secret, swarm_id=swarm_c.swarm_id, timeout=READY_TIMEOUT_S))
                st_c = await client.wait_ready(host_c, peer_c, timeout=READY_TIMEOUT_S)
                compiled_info.update(plan=st_c["plan"], status=st_c.get("compiled"))  # one node's warm-up
                sides += ("compiled", "local_compiled")
                await _ring_gen(host_c, peer_c, ids, a.lan_new_tokens, "none")  # warm-up
                await trio.to_thread.run_sync(run_local, local_c, "local_compiled")
            await _ring_gen(host, peer, ids, a.lan_new_tokens, "none")  # warm-up
            await trio.to_thread.run_sync(run_local)
            for r in range(a.runs):
                k = r % len(sides)  # each side goes first, second, ... in turn
                for side in sides[k:] + sides[:k]:
                    if side == "ring":
                        await ring_run(swarm, host, peer, side, ring_runs)
                    elif side == "base":
                        await ring_run(swarm_b, host_b, peer_b, side, base_runs)  # type: ignore[arg-type]
                    elif side == "compiled":
                        await ring_run(swarm_c, host_c, peer_c, side, compiled_runs)  # type: ignore[arg-type]
                    elif side == "local_compiled":
                        local_c_runs.append(await trio.to_thread.run_sync(run_local, local_c, side))
                    else:
                        local_runs.append(await trio.to_thread.run_sync(run_local))
        return {"plan": plan, "hop_paths": st.get("hop_paths")}

    trace_dir = workdir(a, "lan-trace")
    install_tracer(trace_dir)
    try:
        swarm = start_local_swarm(
            3, model_dir, dtype=a.dtype, threads=a.threads, draft="none", workdir=workdir(a, "lan"), quant=a.quant
        )
    finally:
        uninstall_tracer()
    swarm_b, trace_b = None, workdir(a, "lan-trace-base")
    if a.ab is not None:  # its nodes import the code at a.ab (and the tracer, into their own directory)
        install_tracer(trace_b)
        env = {"PYTHONPATH": os.pathsep.join([str(trace_b), str(a.ab)]), "RING_BENCH_TRACE": str(trace_b)}
        try:
            swarm_b = start_local_swarm(3, model_dir, dtype=a.dtype, threads=a.threads, draft="none",
                                        workdir=workdir(a, "lan-base"), quant=a.quant,
                                        node_env={i: env for i in range(3)})  # fmt: skip
        finally:
            uninstall_tracer()
    swarm_c, compiled_info, trace_c = None, {}, workdir(a, "lan-trace-compiled")
    if a.compiled:  # the same tree, every node compiled (join --compile), the same context and spans
        install_tracer(trace_c)
        try:
            swarm_c = start_local_swarm(3, model_dir, dtype=a.dtype, threads=a.threads, draft="none", workdir=workdir(a, "lan-compiled"),
                                        quant=a.quant, context_tokens=LAN_CONTEXT, compile=True, compile_span=COMPILE_SPAN)  # fmt: skip
        finally:
            uninstall_tracer()
    with swarm, (swarm_b or contextlib.nullcontext()), (swarm_c or contextlib.nullcontext()):
        t0 = time.perf_counter()
        info = trio.run(_with_client, swarm, body)
        wall = time.perf_counter() - t0
        if a.keep:
            info["workdir_logs"] = {i: swarm.log(i)[-2000:] for i in range(3)}
    plan = info["plan"]
    remote_hops = sum(1 for s, d in _hops(plan) if s != d)
    # the same blocks as processes on pipes, no swarm code (pipeline_floor.py), the swarm stopped:
    # floor / local is what the machine allows such a ring, ring / floor what our software costs
    blocks = sorted(tuple(b) for b in plan["blocks"].values())
    floor_runs, floor_local, floor_c = [], [], []
    for _ in range(max(2, a.runs // 2)):
        floor_runs.append(floor_tok_s(model_dir, [(int(x), int(y)) for x, y in blocks], ids, a.lan_new_tokens, DTYPES[a.dtype],
                                      quant=a.quant, head_quant=head_quant))  # fmt: skip
        floor_local.append(run_local()["decode_tokens_per_s"])
        if local_c is not None:  # the compiled ring's own shape: the coordinator's block in the head's process
            cplan = compiled_info["plan"]
            head = cplan["blocks"].get(cplan["coordinator"])
            rest = [(int(x), int(y)) for x, y in sorted(b for p, b in cplan["blocks"].items() if p != cplan["coordinator"])]
            floor_c.append((floor_tok_s(model_dir, rest, ids, a.lan_new_tokens, DTYPES[a.dtype], quant=a.quant,
                                        compiled=(LAN_CONTEXT, COMPILE_SPAN), head_block=tuple(head) if head else None,
                                        head_quant=head_quant),
                            run_local(local_c, "local_compiled")["decode_tokens_per_s"]))  # fmt: skip
    ratios = [
        r["decode_tokens_per_s"] / o["decode_tokens_per_s"]
        for r, o in zip(ring_runs, local_runs, strict=True)
    ]
    ring_tok_s = med([r["decode_tokens_per_s"] for r in ring_runs])
    local_tok_s = med([r["decode_tokens_per_s"] for r in local_runs])
    ring_ms, local_ms = 1000 / ring_tok_s, 1000 / local_tok_s
    return {
        "peers": 3,
        "quant": a.quant,  # the layers' format on both sides (the swarm's setting)
        "head_quant": head_quant,  # the LM head's on both sides (capability.swarm_head_quant)
        "prompt": "chat: " + CHAT_PROMPT,
        "prompt_tokens": len(ids),
        "plan": plan,
        "hop_paths": info.get("hop_paths"),
        "remote_hops": remote_hops,
        "ring_decode_tok_s": round(ring_tok_s, 2),
        "local_decode_tok_s": round(local_tok_s, 2),
        "ring_vs_local": round(med(ratios), 3),
        "ring_vs_local_runs": [round(x, 3) for x in ratios],
        # two more views of the same runs, since one run's ratio swings with the machine's load
        "ring_vs_local_of_medians": round(ring_tok_s / local_tok_s, 3),
        "ring_vs_local_best": round(
            max(r["decode_tokens_per_s"] for r in ring_runs)
            / max(r["decode_tokens_per_s"] for r in local_runs),
            3,
        ),
        "target": 0.85,
        "ring_ms_per_token": round(ring_ms, 1),
        "local_ms_per_token": round(local_ms, 1),
        "ring_traversal_ms": round(med([r["traversal_ms"] for r in ring_runs]), 1),
        "overhead_ms_per_token": round(ring_ms - local_ms, 1),
        "ring_cpu_ms_per_token": round(med([r["cpu_ms_per_token"] for r in ring_runs]), 1),
        "local_cpu_ms_per_token": round(med([r["cpu_ms_per_token"] for r in local_runs]), 1),
        "overhead_ms_per_remote_hop": round((ring_ms - local_ms) / max(remote_hops, 1), 2),
        "greedy_identical_to_local": outputs.get("ring") == outputs.get("local"),
        "floor_blocks": blocks,
        "floor_decode_tok_s": round(med(floor_runs), 2),
        "floor_vs_local": round(med([f / o for f, o in zip(floor_runs, floor_local, strict=True)]), 3),
        "ring_vs_floor": round(ring_tok_s / med(floor_runs), 3),
        "where_the_time_goes": analyse_trace(trace_dir, plan),
        "runs": ring_runs and {"ring": ring_runs, "local": local_runs},
        "wall_s": round(wall, 1),
    } | (_ab_rows(a, base_runs, ring_runs, local_runs, outputs, trace_b, base_plan) if swarm_b is not None else {}) \
      | (_compiled_rows(compiled_runs, local_c_runs, ring_runs, local_runs, outputs, compiled_info, warm_local_s, trace_c, floor_c)
         if swarm_c is not None else {})


def _compiled_rows(comp: list[dict[str, Any]], local_c: list[dict[str, Any]], ring: list[dict[str, Any]],
                   local: list[dict[str, Any]], outputs: dict[str, list[int]], info: dict[str, Any],
                   warm_local_s: float, trace: Path, floor: list[tuple[float, float]]) -> dict[str, Any]:  # fmt: skip
    """--compiled: the compiled ring and the compiled process beside the eager ones, same rounds;
    every ratio the median of the per-round ratios. The compiled floor: the compiled ring's blocks
    as plain processes on pipes, the coordinator's block in the head's process (as in the ring),
    each run beside one compiled process after the swarms stopped."""
    def tok(runs: list[dict[str, Any]]) -> list[float]:
        return [r["decode_tokens_per_s"] for r in runs]

    def paired(xs: list[float], ys: list[float]) -> float:
        return round(med([x / y for x, y in zip(xs, ys, strict=True)]), 3)

    return {"compiled": {
        "ring_decode_tok_s": round(med(tok(comp)), 2),
        "local_decode_tok_s": round(med(tok(local_c)), 2),
        "compiled_ring_vs_eager_ring": paired(tok(comp), tok(ring)),
        "compiled_ring_vs_compiled_local": paired(tok(comp), tok(local_c)),
        "compiled_ring_vs_eager_local": paired(tok(comp), tok(local)),
        "compiled_local_vs_eager_local": paired(tok(local_c), tok(local)),
        "eager_ring_vs_eager_local": paired(tok(ring), tok(local)),
        "compiled_ring_vs_compiled_local_runs": [round(x / y, 3) for x, y in zip(tok(comp), tok(local_c), strict=True)],
        "floor_decode_tok_s": round(med([f for f, _ in floor]), 2),
        "floor_vs_compiled_local": round(med([f / o for f, o in floor]), 3),
        "floor_vs_compiled_local_runs": [round(f / o, 3) for f, o in floor],
        "compiled_ring_vs_floor": round(med(tok(comp)) / med([f for f, _ in floor]), 3),
        "where_the_time_goes": analyse_trace(trace, info["plan"]),
        "greedy_identical": outputs.get("compiled") == outputs.get("local") == outputs.get("local_compiled"),
        "plan": info["plan"],
        "node_status_compiled": info["status"],  # what one node's status says it compiled, and its warm-up
        "local_warm_s": round(warm_local_s, 1),
        "ring_cpu_ms_per_token": round(med([r["cpu_ms_per_token"] for r in comp]), 1),
        "local_cpu_ms_per_token": round(med([r["cpu_ms_per_token"] for r in local_c]), 1),
        "runs": {"compiled_ring": comp, "compiled_local": local_c},
    }}


def _ab_rows(a: argparse.Namespace, base_runs: list[dict[str, Any]], ring_runs: list[dict[str, Any]],
             local_runs: list[dict[str, Any]], outputs: dict[str, list[int]], trace_b: Path,
             plan: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """--ab: the second swarm's figures beside this tree's, from the same rounds."""
    base_trace = analyse_trace(trace_b, plan)
    if base_trace["code"] != [str(a.ab)]:
        raise SystemExit(f"--ab: the base swarm's nodes ran the code in {base_trace['code']}, not {a.ab}")
    tok_s = [r["decode_tokens_per_s"] for r in base_runs]
    ring_vs_base = [r["decode_tokens_per_s"] / b for r, b in zip(ring_runs, tok_s, strict=True)]
    return {"ab": {
        "base_root": str(a.ab),
        "base_git": git_state(Path(a.ab)),
        "ring_vs_base": round(med(ring_vs_base), 3),  # > 1: this tree's ring is faster
        "ring_vs_base_runs": [round(x, 3) for x in ring_vs_base],
        "base_decode_tok_s": round(med(tok_s), 2),
        "base_vs_local": round(med([b / o["decode_tokens_per_s"] for b, o in zip(tok_s, local_runs, strict=True)]), 3),
        "base_ms_per_token": round(1000 / med(tok_s), 1),
        "base_cpu_ms_per_token": round(med([r["cpu_ms_per_token"] for r in base_runs]), 1),
        "base_greedy_identical_to_local": outputs.get("base") == outputs.get("local"),
        "base_blocks": sorted(tuple(b) for b in plan["blocks"].values()),
        "base_where_the_time_goes": base_trace,
        "base_runs": base_runs,
    }}


def _hops(plan: dict[str, Any]) -> list[tuple[str, str]]:
    path = [plan["coordinator"], *plan["ring"], plan["coordinator"]]
    return [(path[i], path[i + 1]) for i in range(len(path) - 1)]


# -- WAN ------------------------------------------------------------------------------------------


def in_flight(rc: dict[str, Any], prompt_tokens: int) -> float:
    """Mean decode chunks in flight by Little's law: chunks sent x median traversal / decode time."""
    decode_chunks = rc["chunks"] - -(-prompt_tokens // DEFAULT_PREFILL_CHUNK)
    decode_s = (len(rc["output_token_ids"]) - 1) / rc["decode_tokens_per_s"]
    return decode_chunks * rc["traversal_ms"] / 1000 / decode_s


def wan_memory(model_dir: Path, dtype: str, n_stages: int, draft: str = "none") -> list[int]:
    """One peer fits only the coordinator part (and ``draft``'s model); ``n_stages`` peers fit
    their layer share and no head."""
    args = ModelArgs.from_dir(model_dir)
    spec = model_spec(args, DTYPES[dtype], 1024)  # swarm/launch.py's default context_tokens
    per_stage = -(-args.n_layers // n_stages) * spec.bytes_per_layer
    stage_mem = int(per_stage + 0.5 * min(spec.bytes_per_layer, spec.coordinator_bytes))
    coord = spec.coordinator_bytes + draft_bytes(draft, args, DTYPES[dtype], 1024)
    return [int(coord * 1.02)] + [stage_mem] * n_stages


def _workloads(tok: Tokenizer) -> dict[str, list[int]]:
    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))

    return {"chat": chat(CHAT_PROMPT), "copy": chat(COPY_PROMPT)}


def _row(rc: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    dr = rc.get("draft") or {}
    return _slim(rc) | {
        "in_flight": in_flight(rc, prompt_tokens),
        "max_depth": ring_depth(rc),
        "mean_in_flight": dr.get("mean_in_flight") or 1.0,
        "ran": dr.get("ran"),
        "policy": dr.get("policy"),
    }


def _compare(none: list[dict[str, Any]], spec: list[dict[str, Any]]) -> dict[str, Any]:
    """Drafted vs one token per traversal, run by run (the two interleaved), and vs the bound."""
    speedups = [s["decode_tokens_per_s"] / n["decode_tokens_per_s"] for s, n in zip(spec, none, strict=True)]
    # bound = tokens committed per traversal x chunks in flight (as the policy issued them) / traversal
    bounds = [s["accepted_per_traversal"] * s["mean_in_flight"] / (s["traversal_ms"] / 1000) for s in spec]
    bounds_max = [s["accepted_per_traversal"] * s["max_depth"] / (s["traversal_ms"] / 1000) for s in spec]
    return {
        "none_decode_tok_s": round(med([n["decode_tokens_per_s"] for n in none]), 2),
        "none_traversal_ms": round(med([n["traversal_ms"] for n in none]), 1),
        "one_token_per_traversal_tok_s": round(1000 / med([n["traversal_ms"] for n in none]), 2),
        "spec_decode_tok_s": round(med([s["decode_tokens_per_s"] for s in spec]), 2),
        "spec_traversal_ms": round(med([s["traversal_ms"] for s in spec]), 1),
        "accepted_per_traversal": round(med([s["accepted_per_traversal"] for s in spec]), 2),
        "accepted_per_round": round(med([s["accepted_per_round"] or 0.0 for s in spec]), 2),
        "spec_vs_one_per_traversal": round(med(speedups), 3),
        "spec_vs_one_per_traversal_runs": [round(x, 3) for x in speedups],
        "chunks_in_flight_issued": round(med([s["mean_in_flight"] for s in spec]), 2),
        "policy_max_depth": max(s["max_depth"] for s in spec),
        "bound_tok_s": round(med(bounds), 2),
        "spec_vs_bound": round(med([s["decode_tokens_per_s"] / b for s, b in zip(spec, bounds, strict=True)]), 3),
        "spec_vs_bound_at_max_depth": round(
            med([s["decode_tokens_per_s"] / b for s, b in zip(spec, bounds_max, strict=True)]), 3
        ),
        "spec_in_flight_measured": round(med([s["in_flight"] for s in spec]), 2),
    }


def wan_swarm(model_dir: Path, tok: Tokenizer, a: argparse.Namespace, draft: str, sides: tuple[str, ...]) -> dict[str, Any]:
    """One WAN swarm whose nodes hold ``draft``: each workload run with each of ``sides`` (request
    drafters), interleaved, ``a.wan_runs`` times."""
    workloads = _workloads(tok)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {s: [] for s in sides} for w in workloads}
    outputs: dict[str, dict[str, list[int]]] = {w: {} for w in workloads}
    receipts: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in workloads}

    async def body(host: Any, peer: str, st: dict[str, Any]) -> dict[str, Any]:
        receipt = await _ring_gen(host, peer, workloads["chat"], 8, "none")  # warm-up, and the plan
        for w in workloads:
            await _ring_gen(host, peer, workloads[w], 8, sides[-1])
        for r in range(a.wan_runs):
            for w, ids in workloads.items():
                for side in sides if r % 2 == 0 else tuple(reversed(sides)):
                    rc = await _ring_gen(host, peer, ids, a.new_tokens, side)
                    outputs[w][side] = rc["output_token_ids"]
                    receipts[w][side] = rc
                    runs[w][side].append(_row(rc, len(ids)))
        return {"coordinator": receipt["coordinator"], "ring": receipt["ring"], "hop_paths": st.get("hop_paths"),
                "loop": st.get("loop")}  # fmt: skip

    with start_local_swarm(
        4, model_dir, dtype=a.dtype, threads=a.threads, draft=draft, delay_ms=a.delay_ms,
        memory_bytes=wan_memory(model_dir, a.dtype, 3, draft), workdir=workdir(a, f"wan-{draft}"),
    ) as swarm:  # fmt: skip
        t0 = time.perf_counter()
        info = trio.run(_with_client, swarm, body)
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {
        "node_draft": draft,
        "coordinator": info["coordinator"],
        "ring": info["ring"],
        "layerless_coordinator": info["coordinator"] not in info["ring"],
        "hops": len(info["ring"]) + (info["coordinator"] not in info["ring"]),
        "hop_paths": info["hop_paths"],
        "workloads": {},
        "wall_s": round(wall, 1),
    }
    for w in workloads:
        rows: dict[str, Any] = {"prompt_tokens": len(workloads[w])}
        for side in sides[1:]:
            rc = receipts[w][side]
            rows[side] = _compare(runs[w]["none"], runs[w][side]) | {
                "ran": rc["draft"].get("ran"),
                "why": rc["draft"].get("why"),
                "greedy_identical_to_none": outputs[w][side] == outputs[w]["none"],
                "one_box_reference": one_box_reference(model_dir, workloads[w], a, rc),
                "output_text": tok.decode(outputs[w][side])[:200],
            }
        rows["runs"] = runs[w]
        out["workloads"][w] = rows
    return out


def bench_wan(model_dir: Path, tok: Tokenizer, a: argparse.Namespace) -> dict[str, Any]:
    """Every draft of ``--drafts`` on its own WAN swarm (a node holds one draft model), each
    against one token per traversal on that same swarm; prompt lookup on the first."""
    out: dict[str, Any] = {"peers": 4, "delay_ms_one_way": a.delay_ms, "drafts": {}}
    for i, draft in enumerate(a.drafts):
        sides = ("none", "ngram", "model") if i == 0 else ("none", "model")
        out["drafts"][draft] = wan_swarm(model_dir, tok, a, draft, sides)
        print(json.dumps(summary_wan(out), indent=1), file=sys.stderr)
    chat = {d: r["workloads"]["chat"]["model"]["spec_vs_one_per_traversal"] for d, r in out["drafts"].items()}
    best = max(chat, key=lambda d: chat[d])
    out["best_draft_on_chat"] = best
    out["chat"] = out["drafts"][best]["workloads"]["chat"]["model"] | {"draft": best}
    out["copy"] = out["drafts"][best]["workloads"]["copy"]["model"] | {"draft": best}
    out["targets"] = {"chat_spec_vs_one_per_traversal": 2.5, "spec_vs_bound": 0.8}
    return out


def summary_wan(wan: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for d, r in wan.get("drafts", {}).items():
        for w, rows in r["workloads"].items():
            for side, row in rows.items():
                if isinstance(row, dict) and "spec_vs_one_per_traversal" in row:
                    out[f"{d}/{w}/{side}"] = {k: row[k] for k in (
                        "spec_vs_one_per_traversal", "spec_vs_bound", "accepted_per_round", "accepted_per_traversal",
                        "chunks_in_flight_issued", "spec_decode_tok_s", "none_decode_tok_s")}  # fmt: skip
    return out


def one_box_reference(model_dir: Path, ids: list[int], a: argparse.Namespace, rc: dict[str, Any]) -> dict[str, Any]:
    """The receipt's drafter and policy in one process (``shard-swarm run --receipt``): the
    acceptance the drafter alone gets, and whether the ring's greedy output is token-identical
    to it (same chunk schedule, hence the same bf16 numbers)."""
    local = LocalModel.load(model_dir, stages=1, dtype=DTYPES[a.dtype])
    dr = rc.get("draft") or {}
    ran = dr.get("ran", "ngram")
    if ran == "ngram":
        drafter: Any = NgramDrafter()
    else:
        drafter = load_draft_model(parse_draft(ran), head=local.head, target=local.ckpt, dtype=DTYPES[a.dtype],
                                   device="cpu").drafter(len(ids) + a.new_tokens + 16)  # fmt: skip
    policy = KPolicy(**dr["policy"]) if dr.get("policy") else KPolicy(max_depth=ring_depth(rc), draft_cost=0.0)
    res = generate(local, ids, max_new_tokens=len(rc["output_token_ids"]), drafter=drafter, policy=policy)
    return {
        "accepted_per_round": res.accepted_per_round,
        "acceptance_rate": res.acceptance_rate,
        "rounds": res.rounds,
        "decode_tokens_per_s": round(res.decode_tokens_per_s, 2),
        "ring_greedy_identical_to_one_box": rc["output_token_ids"] == res.output_token_ids,
    }


# -- LAN with auto -----------------------------------------------------------------------------


def bench_lan_auto(model_dir: Path, tok: Tokenizer, a: argparse.Namespace) -> dict[str, Any]:
    """3 peers on loopback holding ``auto``'s draft: requests with ``auto`` vs ``none``, interleaved."""
    ids = _workloads(tok)["chat"]
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "auto": []}
    last: dict[str, dict[str, Any]] = {}

    async def body(host: Any, peer: str, st: dict[str, Any]) -> dict[str, Any]:
        for side in ("none", "auto"):
            await _ring_gen(host, peer, ids, 8, side)  # warm-up
        for r in range(a.runs):
            for side in ("none", "auto") if r % 2 == 0 else ("auto", "none"):
                rc = await _ring_gen(host, peer, ids, a.lan_new_tokens, side)
                last[side] = rc
                runs[side].append(_row(rc, len(ids)))
        return {"plan": st["plan"]}

    with start_local_swarm(3, model_dir, dtype=a.dtype, threads=a.threads, draft="auto",
                           workdir=workdir(a, "lan-auto")) as swarm:  # fmt: skip
        info = trio.run(_with_client, swarm, body)
    ratios = [x["decode_tokens_per_s"] / n["decode_tokens_per_s"] for x, n in zip(runs["auto"], runs["none"], strict=True)]
    return {
        "peers": 3,
        "plan": info["plan"],
        "auto_vs_none": round(med(ratios), 3),
        "auto_vs_none_runs": [round(x, 3) for x in ratios],
        "target": 0.98,
        "auto_ran": [r["ran"] for r in runs["auto"]],
        "auto_why_last": last["auto"]["draft"].get("why"),
        "none_decode_tok_s": round(med([n["decode_tokens_per_s"] for n in runs["none"]]), 2),
        "auto_decode_tok_s": round(med([x["decode_tokens_per_s"] for x in runs["auto"]]), 2),
        "none_traversal_ms": round(med([n["traversal_ms"] for n in runs["none"]]), 1),
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7, help="LAN runs per side (default 7)")
    p.add_argument("--lan-new-tokens", type=int, default=32)
    p.add_argument(
        "--wan-runs", type=int, default=3, help="WAN runs per side and workload (default 3)"
    )
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--quant", default="none", choices=("none", "int8", "int4"),
                   help="the LAN part's layers (both sides; the swarm's quant, as an invite sets it)")
    p.add_argument("--only", choices=("lan", "lan-auto", "wan"), default=None)
    p.add_argument("--drafts", default="int4,int8,self", help="draft models for the WAN rows (comma-separated)")
    p.add_argument(
        "--quick", action="store_true", help="2 runs per side, 24 new tokens (a smoke run)"
    )
    p.add_argument("--keep", action="store_true", help="keep the tail of the node logs in the JSON")
    p.add_argument("--ab", type=Path, default=None,
                   help="LAN: a second swarm whose nodes run the code of this tree (e.g. a git worktree of the "
                        "base commit), its generations in every round beside this tree's ring and one process")
    p.add_argument("--compiled", action="store_true",
                   help="LAN: a third side, a ring of compiled nodes (join --compile), and one compiled process, "
                        "in every round beside the eager ring and process")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "ring-bench"),
        help="node configs and logs (default: $TMPDIR/ring-bench/{lan,wan})",
    )
    a = p.parse_args()
    a.drafts = [d for d in a.drafts.split(",") if d]
    if a.ab is not None:
        # a node runs `python -m swarm.node`, which imports swarm from its working directory
        # first: run from one without a swarm/ package, so each swarm imports its own tree
        a.ab, a.out = a.ab.resolve(), a.out.resolve()
        os.chdir(tempfile.gettempdir())
    if a.quick:
        a.runs, a.wan_runs, a.new_tokens, a.lan_new_tokens = 2, 1, 24, 24
    torch.set_num_threads(a.threads)
    model_dir = default_model_dir()
    tok = Tokenizer.from_dir(model_dir)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "model": model_dir.name,
        "dtype": a.dtype,
        "threads_per_process": a.threads,
        "new_tokens": {"lan": a.lan_new_tokens, "wan": a.new_tokens},
        "lan_runs_per_side": a.runs,
        "wan_runs_per_side": a.wan_runs,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "native_bf16": native_bf16(),
        },
        "notes": NOTES,
        "git": git_state(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if a.only in (None, "lan"):
        result["lan"] = bench_lan(model_dir, tok, a)
        print(
            json.dumps(
                {k: v for k, v in result["lan"].items() if k not in ("runs", "plan")}, indent=1
            ),
            file=sys.stderr,
        )
    if a.only in (None, "lan-auto"):
        result["lan_auto"] = bench_lan_auto(model_dir, tok, a)
    if a.only in (None, "wan"):
        result["wan"] = bench_wan(model_dir, tok, a)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.only and a.out.exists():  # one part re-run: the file keeps the other parts' last figures
        old = json.loads(a.out.read_text())
        parts = {"lan": "lan", "lan-auto": "lan_auto", "wan": "wan"}
        result = {**old, parts[a.only]: result[parts[a.only]], "notes": NOTES,
                  "runs_by_part": {**old.get("runs_by_part", {}), parts[a.only]: {k: result[k] for k in ("git", "when")}}}  # fmt: skip
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    summary: dict[str, Any] = {"lan_ring_vs_local": result.get("lan", {}).get("ring_vs_local"),
                               "lan_auto_vs_none": result.get("lan_auto", {}).get("auto_vs_none")}
    summary |= summary_wan(result.get("wan", {}))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
