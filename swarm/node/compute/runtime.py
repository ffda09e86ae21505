"""What a node holds of the model: its checkpoint, the blocks and head it loaded, and where
torch work runs.

:class:`Compute` is the one place torch work (and a long prompt's tokenizing) is handed off: a
worker thread behind one limiter per process (so the trio loop that answers heartbeats never
waits on a forward), or inline on the trio thread for in-memory tests under a mock clock (a
thread hand-off there would let the clock jump while the work runs). A caller may still run work
it predicts quick on the trio thread (its placement rule: model/batched.py ``InlinePolicy``);
what leaves the loop leaves through :meth:`Compute.run` or :attr:`Compute.to_thread`. Only the
fetch path's disk reads and writes (members.py, rangepipe.py) take worker threads of their own:
they are file I/O, not torch, and must not queue behind a forward. :class:`Models` loads a stage's block (kept across epochs while
the block is unchanged), the coordinator's head and the tokenizer, each once, off the loop.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import trio

from swarm.errors import ModelError, SwarmError
from swarm.model import rows
from swarm.model.capability import kv_format_problem, probe, swarm_head_quant
from swarm.model.config import ModelArgs
from swarm.model.devices import synchronize
from swarm.model.quant import quantize_block
from swarm.model.stage import Head, Stage
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import Checkpoint, open_checkpoint
from swarm.node.compute import memory
from swarm.node.compute.drafting import DraftHolder
from swarm.node.compute.fetching import BlockFetcher
from swarm.node.notices import Notices
from swarm.node.settings import NodeSettings, model_spec

T = TypeVar("T")


class Compute:
    """Where torch work runs (see the module docstring). ``limiter`` is the process's one."""

    def __init__(self, *, threads: bool = True) -> None:
        self.limiter = trio.CapacityLimiter(1)
        self.threads = threads
        # the hand-off itself, for a caller that has decided on a thread: one call into trio with
        # no frame of ours between (a stage's forward takes it, on the hidden state's path, whose
        # files benchmarks/count_hops.py counts)
        self.to_thread = functools.partial(trio.to_thread.run_sync, limiter=self.limiter)

    async def run(
        self, fn: Callable[..., T], *args: Any, limited: bool = True, limiter: trio.CapacityLimiter | None = None,
        abandon_on_cancel: bool = False,
    ) -> T:  # fmt: skip
        """``fn(*args)`` off the trio loop, in a worker thread behind the process's compute limiter
        (``limiter``: another, such as the draft model's; ``limited=False``: none), or inline when
        this Compute runs inline. ``abandon_on_cancel``: a cancelled call returns at once while
        the thread finishes (trio.to_thread.run_sync)."""
        if not self.threads:
            return fn(*args)
        use = (limiter or self.limiter) if limited else None
        return await trio.to_thread.run_sync(fn, *args, limiter=use, abandon_on_cancel=abandon_on_cancel)  # type: ignore[call-arg]


PROBE_CACHE_BYTES = 32 * 1024 * 1024  # a last-level cache assumed where none can be read (this box's L3)
MAX_PROBE_LAYERS = 8


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where it cannot be read."""
    import pathlib

    sizes = []
    for f in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]] if text[-1] in "KMG" else int(text))
    return max(sizes) if sizes else None


def probe_layers(layer_bytes: int, cache_bytes: int | None) -> int:
    """How many synthetic layers the ms-per-layer probe runs through: enough that their weights
    are twice the last-level cache, as a block's are (``cache_bytes``; None: PROBE_CACHE_BYTES),
    at most MAX_PROBE_LAYERS; one where a layer alone is that big (a large model's). One small
    layer alone runs from the cache: on the bundled model it measured 0.49-0.66 of a real block's
    time per layer, over 4-8 layers 0.96-1.0 (benchmarks/bench_probe_compiled.py), and the plan
    predicted about half the compute its ring then ran (bench_compiled_plan.py)."""
    want = 2 * (cache_bytes or PROBE_CACHE_BYTES)
    return max(1, min(MAX_PROBE_LAYERS, -(-want // max(1, layer_bytes))))


def measure_ms_per_layer(
    args: ModelArgs, dtype: torch.dtype, device: str, *, repeats: int = 15, quant: str = "none", compile: bool = False
) -> float:
    """Median time of one decoder layer on one token, with random weights of the model's shapes
    (on an accelerator each pass is waited for, so the figure is the work, not its launch),
    through as many layers as take twice the CPU's cache (probe_layers: a block's weights come
    from memory, not the cache), divided by their count.

    ``compile`` (join --compile): the step this node will run, the layer's one-token step through
    the compiled graph (model/compiled.py; one graph of the probe's layers at the shortest span and one row, compiled
    once per machine and loaded from inductor's on-disk cache after), where the layer can compile;
    the eager figure where it cannot. The planner splits blocks by the advertised figure, and a
    compiled step runs a layer 1.1-1.5x faster than eager (benchmarks/README.md, bench_ring.py
    --compiled: the eager figure made the plan's predicted compute that much too slow)."""
    from swarm.model.quant import layer_bytes

    dev = torch.device(device)
    n = probe_layers(layer_bytes(args, quant, dtype.itemsize), last_level_cache_bytes())
    stage = Stage(args, 0, min(n, args.n_layers), dtype=dtype, device=device)
    stage = stage.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.0, 0.02)
    stage.requires_grad_(False)
    quantize_block(stage, quant, dtype=dtype)
    rows.prove(stage)  # which row counts a replay may merge (rows.py): proven here, off the re-plan's path
    if compile:
        from swarm.model.compiled import MIN_SPAN, unsupported, warm_compiled

        if unsupported(stage) is None:
            # the probe's steps all read the one span, one row each: one graph, not one per row count
            stage.enable_compiled(min(MIN_SPAN, args.max_seq_len), rows=(1,))
            warm_compiled(stage, spans=1)
    stage.open_session("probe", repeats + 2)
    h = torch.randn(1, args.dim, dtype=dtype, device=device)
    times = []
    stage.forward("probe", h)  # warm-up: kernels chosen, caches allocated (not timed)
    synchronize(dev)
    for _ in range(repeats):
        t0 = time.perf_counter()
        stage.forward("probe", h)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    stage.close_session("probe")
    times.sort()
    return 1000.0 * times[len(times) // 2] / (stage.end - stage.start)


COMPILE_SHARE = 0.5  # of the leader's load wait (NodeSettings.load_timeout_s) a block's fetch, load and compile may take


def warm_within(stage: Stage, deadline: float, clock: Callable[[], float] = time.monotonic) -> list[int]:
    """Warm ``stage``'s compiled spans one graph at a time, shortest first, while the next one is
    predicted to be done by ``deadline`` (``clock``'s time; predicted: it takes as long as the
    slowest so far; the first is always compiled). Spans it leaves out run eagerly: the step's
    ``longest`` is lowered to the last span compiled, so no graph is compiled while serving. The
    spans compiled.

    Why: a node compiles before it reports its block loaded, and the leader waits a bounded time
    for that report (NodeSettings.load_timeout_s); a block of many layers on a slow CPU could take
    longer to compile all its spans (~5-25 s a graph for 15 small layers on 2 cores, up to 5 graphs;
    longer per layer on bigger models). Past the wait the set-up failed and was retried at once, and
    the retry found the block loaded, answered while the compile still held the compute thread, and
    the ring's first tokens waited behind it. Bounded here, the node serves in time with fewer
    compiled spans and says so (status ``eager_from``)."""
    from swarm.model.compiled import n_spans, warm_compiled

    step = stage.compiled
    assert step is not None
    wanted = n_spans(step.longest)
    spans: list[int] = []
    slowest = 0.0
    while len(spans) < wanted:
        if spans and clock() + slowest > deadline:
            step.longest = spans[-1]  # steps at later positions run eagerly (Stage.forward)
            break
        t0 = clock()
        spans = warm_compiled(stage, spans=len(spans) + 1)  # the spans before it run again: one step each
        slowest = max(slowest, clock() - t0)
    return spans


class Models:
    """The checkpoint and what this node loaded of it (one block, the head, the tokenizer)."""

    def __init__(self, settings: NodeSettings, compute: Compute, notices: Notices) -> None:
        assert settings.model_dir is not None
        self.settings = settings
        self.compute = compute
        self.notices = notices
        self.ckpt: Checkpoint = open_checkpoint(settings.model_dir)
        self.args = self.ckpt.args
        self.dtype: torch.dtype = settings.dtype if settings.dtype is not None else torch.bfloat16
        # the planner's view at 2 bytes a value whatever this node serves: the same on every peer
        # of a mixed ring; an fp32 node advertises its memory in that unit (settings.plan_memory)
        self.spec = model_spec(self.args, torch.bfloat16, settings.context_tokens, settings.quant, settings.kv_cache,
                               settings.sessions)
        problem = kv_format_problem(probe(torch.device(settings.device)), settings.kv_cache)
        if problem is not None:  # refused at start, before the leader plans a block onto this peer
            raise ModelError(f"this swarm's invite holds the KV cache as {settings.kv_cache}: {problem}")
        self.tokenizer: Tokenizer | None = None
        self.ms_per_layer = 0.0
        self._stages: dict[tuple[int, int], Stage] = {}
        self._compiled: dict[tuple[int, int], trio.Event] = {}  # set once a loaded block is compiled (or needs not be)
        self._head: Head | None = None
        # join --compile: what this node's stage compiled (status "compiled"; None: not asked)
        self.compiled: dict[str, Any] | None = None
        self.drafts = DraftHolder(settings.draft, compute)  # its draft model (drafting.py)
        self.fetch = BlockFetcher(settings, compute, notices) if settings.fetch_dir is not None else None

    @property
    def context_tokens(self) -> int:
        """The context this node serves: the swarm's (settings), at most the model's own."""
        return min(self.settings.context_tokens, self.args.max_seq_len)

    async def measure(self, known: float | None = None) -> float:
        """This node's time per layer: measured, or ``known`` (a test's figure, no measuring)."""
        s = self.settings
        self.ms_per_layer = known if known is not None else await self.compute.run(
            lambda: measure_ms_per_layer(self.args, self.dtype, s.device, quant=s.quant, compile=s.compile)
        )  # fmt: skip
        return self.ms_per_layer

    async def stage(self, a: int, b: int) -> Stage:
        """Layers [a, b): the block already held, or loaded (the old one freed first). One that
        does not fit raises :class:`CannotLoad` (the caller lowers this peer's offer: Epochs._load)."""
        cached = self._stages.get((a, b))
        if cached is not None:
            compiling = self._compiled.get((a, b))
            if compiling is not None:
                await compiling.wait()  # a second ask while its first compiles waits for it
            return cached
        s = self.settings
        # the leader waits load_timeout_s for our answer from about now: compiling takes what the
        # fetch and load leave of its share (warm_within)
        deadline = time.monotonic() + COMPILE_SHARE * s.load_timeout_s
        # free the old block before loading the new one: its tensors now, although the ended epoch's
        # worker still holds the Stage until its task unwinds, which came after the new block's load
        # had begun (measured: a coordinator growing [0, 10) to [0, 15) peaked at both blocks, 889 MB
        # against 747 once the old one had gone)
        for old in self._stages.values():
            old.release()
        self._stages.clear()
        self._compiled.clear()
        memory.release(s.device)
        if self.fetch is not None:
            await self.fetch.block(a, b)  # only what the cache does not hold yet moves
        self.notices.event(f"loading layers [{a}, {b})")
        self.notices.life("loading", layers=[a, b], done=False)
        t0 = trio.current_time()

        def load() -> Stage:
            # two epochs' set-ups may ask for the same block at once (a re-plan while the first
            # loads): loads queue on the compute limiter, so the second finds the first's block
            # here and never holds two copies (a loaded run's stages were OOM-killed so, issue 26)
            done = self._stages.get((a, b))
            if done is not None:
                return done
            memory.check_load(b - a)
            stage = Stage.load(self.args, self.ckpt.source, a, b, dtype=self.dtype, device=s.device, quant=s.quant,
                               kv_cache=s.kv_cache)
            self._stages[(a, b)] = stage  # here, not after the await: its caller may have been cancelled
            self._compiled.setdefault((a, b), trio.Event())  # set once compiled (or not asked to)
            return stage

        try:
            stage = await self.compute.run(load)
        except memory.OOM_ERRORS as exc:
            memory.release(s.device)
            self.notices.life("loading", layers=[a, b], done=False, error=memory.describe(exc))
            raise memory.CannotLoad(f"cannot load layers [{a}, {b}): {memory.describe(exc)}") from None
        self.notices.life("loading", layers=[a, b], done=True, seconds=round(trio.current_time() - t0, 3))
        ready = self._compiled.setdefault((a, b), trio.Event())
        try:
            if s.compile:
                await self._compile(stage, deadline)
        finally:
            ready.set()
        self._stages[(a, b)] = stage
        return stage

    async def _compile(self, stage: Stage, deadline: float) -> None:
        """join --compile: the stage's decode step (one token, and verify chunks padded to
        compiled.ROWS: a graph per span and row count) compiled for the swarm's context (the
        capacity every session's cache already has: StageWorker opens each at ``context_tokens``,
        which the budget counts) and its spans up to ``compile_span`` warmed, before the block is
        reported loaded, so no user token pays for it; as many of them as fit before ``deadline``
        (``time.monotonic``: warm_within), the rest eager. A stage that cannot compile serves
        eagerly and says why, once."""
        from swarm.model.compiled import n_spans, unsupported

        s = self.settings
        why = unsupported(stage)
        if why is not None:
            if self.compiled is None or self.compiled.get("eager") != why:
                self.notices.event(f"--compile: {why}; serving eagerly")
            self.compiled = {"layers": [stage.start, stage.end], "eager": why, "spans": [], "rows": [], "capacity": None,
                             "eager_from": 0, "warm_s": None}  # fmt: skip
            self.notices.life("compiled", layers=[stage.start, stage.end], spans=[], eager_from=0, eager=why)
            return
        self.notices.event(f"compiling the decode step of layers [{stage.start}, {stage.end}) (cached after the first start)")
        t0 = time.perf_counter()

        asked = 0

        def build() -> list[int]:
            nonlocal asked
            if stage.compiled is None:  # a second ask for a block while it loads shares its step (stage())
                stage.enable_compiled(self.context_tokens, s.compile_span)
            assert stage.compiled is not None
            asked = n_spans(stage.compiled.longest)
            return warm_within(stage, deadline)

        spans = await self.compute.run(build)
        assert stage.compiled is not None
        self.compiled = {"layers": [stage.start, stage.end], "eager": None, "spans": spans,
                         "rows": list(stage.compiled.rows), "capacity": stage.compiled.capacity,
                         "eager_from": stage.compiled.longest if stage.compiled.longest < stage.compiled.capacity else None,
                         "warm_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
        cut = "" if len(spans) == asked else (
            f"; {asked - len(spans)} longer span(s) left eager: compiling them would pass half the leader's "
            f"{s.load_timeout_s:.0f} s wait for this block (steps from position {spans[-1]} run eagerly)")
        self.notices.event(f"compiled spans {spans} in {self.compiled['warm_s']} s{cut}")
        self.notices.life("compiled", layers=[stage.start, stage.end], spans=spans, eager_from=self.compiled["eager_from"],
                          eager=None, seconds=self.compiled["warm_s"])  # fmt: skip

    def ran(self, block: tuple[int, int]) -> dict[str, Any]:
        """How this node's stage of ``block`` runs its one-token decode steps, as its ``loaded``
        reply tells the leader and receipts name it (proto/control.py ``StageRun``): the spans
        compiled and from which position it steps eagerly, or why it runs eagerly; and its dtype,
        since a bf16 compiled stage may flip a near-tie against an eager box (model/compiled.py)."""
        from swarm.model.dtypes import dtype_name

        c = self.compiled
        dtype = dtype_name(self.dtype)
        if c is None or c["layers"] != list(block):
            return {"spans": [], "eager_from": 0, "eager": f"layers {list(block)} not compiled", "dtype": dtype}
        return {"spans": list(c["spans"]), "eager_from": c["eager_from"], "eager": c["eager"][:300] if c["eager"] else None,
                "dtype": dtype}  # fmt: skip

    async def head(self) -> Head:
        if self._head is None:
            if self.fetch is not None:
                await self.fetch.head()
            self._head = await self.compute.run(self._load_head)
        return self._head

    @property
    def head_quant(self) -> str:
        """How the head loaded here is held ("none" before it loads: Head.head_quant)."""
        return "none" if self._head is None else self._head.head_quant

    def _load_head(self) -> Head:
        """The embedding, final norm and LM head; the head held int8 where a quantized swarm's
        rule says so (capability.swarm_head_quant; the budget counts it: ModelArgs.head_int8_bytes)."""
        s = self.settings
        head = Head.load(self.args, self.ckpt.source, dtype=self.dtype, device=s.device)
        if swarm_head_quant(s.quant, self.args.head_stored, torch.device(s.device), self.dtype) == "int8":
            head.hold_head_int8()
        return head

    async def load_tokenizer(self) -> None:
        if self.tokenizer is None and self.settings.model_dir is not None:
            with contextlib.suppress(SwarmError):  # parsing tokenizer.json takes a while: off the loop
                self.tokenizer = await self.compute.run(Tokenizer.load, self.settings.model_dir, limited=False)  # dir or .gguf
