"""A static-shape, compiled decode step for a stage: one-token steps and drafted verify chunks
(issue 30, opt-in: ``--compile``).

Theory of operation
-------------------
On small models the eager decode step is dominated by Python dispatch: a layer of the bundled
SmolLM2-135M is a handful of tiny GEMMs, and each op pays torch's per-call overhead. This module
runs the *same* hand-written layer math (llama_layers.py: RMSNorm, RoPE, packed-GQA SDPA, SwiGLU)
for a token, or a small chunk of them, through all of a stage's layers as one ``torch.compile``
graph (inductor, ``fullgraph=True``, ``dynamic=False``), so the step costs one call and fused C++
kernels.

Static shapes, so that a growing session does not recompile at every token:

- The KV cache of a compiled stage is preallocated at one fixed ``capacity`` for every session
  (the cache's layout (1, KV, capacity, hd) is then the same tensor shape and strides for all
  sessions; the eager path uses the same buffers, so chunks, rollbacks and batches interleave
  with compiled steps freely).
- The positions are an int64 tensor, not Python ints: the new keys and values are written with
  ``index_copy_`` and the rotary rows are an ``index_select`` of a (capacity, hd) table built once.
- Attention reads a *span* of the cache, the chunk's end rounded up to a power of two (at least
  ``MIN_SPAN``), with the keys past each row's position masked out. One graph per span and row
  count, so a session of n tokens compiles at most ``(1 + log2(n / MIN_SPAN)) * len(ROWS)``
  graphs, shared by all sessions. ``torch._dynamo``'s recompile limit is raised to that count
  (it defaults to 8).

Verify chunks (1 + K drafted tokens, K <= KPolicy.k_max = 8) are padded up to a row count of
:data:`ROWS` (1, 2, 4, 8; a 9-row chunk runs eagerly). Row i sits at position ``pos + i`` and
sees keys ``0 .. pos + i`` (the mask is causal inside the chunk), so no real row sees a later row
or a padded one. The padded rows are zeros (finite: a masked key's value times 0 stays 0) and
write their keys and values past the real rows, so past ``cache.length`` once the chunk has
advanced it: garbage by the cache's contract, never read, overwritten by the next chunk (a
rollback only moves the length back further). A chunk whose padded end would pass the cache's
capacity, or whose real rows reach past the compiled ``longest`` span, runs eagerly
(:meth:`CompiledStep.takes`; ``step`` refuses it too). Which row counts, by measurement
(benchmarks/README.md: the bundled model, 10 layers, 1 thread): the compiled step's time grows
with its rows as eager's does (bf16 int4: 4.3 ms at 2 rows, 5.5 at 4, 9.3 at 8; eager 5.8, 7.1,
11.0), so padding costs about what the padded rows would cost eagerly; 1, 2, 4, 8 keep every
padded chunk near or under eager's time, where more row counts would each add a graph per span
(about 15 s each to compile for 10 layers) for little.

No host syncs inside the step: nothing is read back to Python between layers.

What is promised: in fp32 the compiled step's greedy tokens equal the eager step's, dense or
int8/int4 (the tests check it on the bundled model, and with the drafter's verify chunks through
the compiled chunk graphs, rolled back part-way as rejected drafts are); the arithmetic differs only in summation order (fused kernels, the masked padded span),
so logits agree to ~1e-5. In bf16 the bits differ (inductor keeps fp32 intermediates inside a
fused kernel where eager rounds after every op): the compiled logits stay within 5% of the logit
range of eager bf16's (8% with int8/int4 layers, whose packed kernels' outputs are rounded to bf16
before the fused epilogues) and no farther from the fp32 model's than twice eager bf16's are (the
test's bounds), so greedy tokens may differ at near-ties: a compiled bf16 run is not a ring's
bit-exact reference (replay a bf16 receipt with ``run`` without ``--compile``).

Scope: the hand-written Llama-family dense layers (plain Llama / SmolLM / Qwen2 / unwindowed
Mistral), the unquantized KV cache (``kv_cache="auto"``), on a CPU; weights dense or int8/int4
(quant.QuantLinear: torch's packed kernels ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``
are aten ops, which inductor calls as extern kernels inside the graph, and the same ops eager calls,
so a compiled int4 step multiplies by the same integers and scales; a ``dequant`` layer's
dequantization is traced like any other op). Anything else (transformers' layers: MoE, Gemma,
windows; int8/fp8 KV; CUDA/MPS, not measured) raises :class:`ModelError` saying why, and the
caller runs eagerly. Compiled: a lone session's one-token steps and chunks of up to 8 rows
(drafted verify chunks); prompt pieces (64 rows), 9-row chunks, batches of sessions (batched.py)
and row groups (rows.py) keep the eager path on the same caches.

Inductor's CPU kernels take the thread count at compile time: set ``torch.set_num_threads``
before :func:`warm_compiled` (the CLI does).

In a node (``join --compile``; node/compute/runtime.py ``Models._compile``): the capacity is the
swarm's context, the length every StageWorker session's cache already has (so a compiled stage
holds no more KV than an eager one, and the budget counts it as is), and only the spans up to
the node's ``compile_span`` (default :data:`LONGEST_SPAN`) are compiled before the block is
reported loaded, each at every row count; chunks reaching later positions run eagerly, so no
graph is ever compiled while serving. The ring's contract with compiled stages: in fp32 its greedy tokens equal one eager
box's, also after a re-plan whose replay rebuilds caches through the eager row path and
continues compiled (tests/node/test_compiled_processes.py); the compiled step's hidden states
differ from eager's in the last bits (~1e-5), as batched rows do, so the promise is the tokens,
not the bits. In bf16 a ring with compiled stages may flip a near-tie against an eager box, and
against itself across a re-plan (the replayed positions are recomputed eagerly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import ModelError
from swarm.model import llama_layers

if TYPE_CHECKING:
    from swarm.model.kvcache import KVCache
    from swarm.model.stage import Stage

MIN_SPAN = 64  # the smallest attention span compiled: positions 0..63 share one graph
# the longest span a node compiles (NodeSettings.compile_span): at most 1 + log2(1024 / 64) = 5
# graphs (~20 s each on a 2-core box, the bundled model), steps at later positions run eagerly;
# a span marked dynamic (one graph) measured slower than eager (benchmarks/README.md)
LONGEST_SPAN = 1024
# the row counts compiled: one-token steps, and drafted verify chunks (2..9 rows: KPolicy.k_max
# drafts and the bonus row) padded up to the next of these; a longer chunk runs eagerly
ROWS = (1, 2, 4, 8)
_graph_budget = 0  # graphs the CompiledSteps of this process may compile (recompile_limit)


def span_for(length: int, capacity: int) -> int:
    """The padded attention span for a cache holding ``length`` entries (the new one included):
    the next power of two at or above it, at least MIN_SPAN, at most ``capacity``."""
    span = MIN_SPAN
    while span < length:
        span *= 2
    return min(span, capacity)


def n_spans(capacity: int) -> int:
    """How many spans (so graphs) a session of up to ``capacity`` tokens can use."""
    spans, length = set(), 1
    while True:
        spans.add(span_for(length, capacity))
        if length >= capacity:
            return len(spans)
        length = min(2 * length, capacity)


def longest_span(capacity: int, limit: int | None) -> int:
    """The longest span compiled for a cache of ``capacity`` under ``limit`` (None: all of them):
    ``limit`` rounded down to a power of two, at least MIN_SPAN, at most ``capacity``."""
    if limit is None or limit >= capacity:
        return capacity
    span = MIN_SPAN
    while 2 * span <= limit:
        span *= 2
    return min(span, capacity)


def unsupported(stage: Stage) -> str | None:
    """Why ``stage`` cannot run a compiled decode step, or None where it can."""
    where = f"stage [{stage.start}, {stage.end}) of {stage.args.architecture}"
    if stage.runtime != "handwritten":
        return (f"{where} runs transformers' layers (MoE, Gemma, windowed attention or another "
                "family the hand-written Llama layers do not cover); the compiled decode step "
                "covers only the dense Llama-family layers: run it eagerly")
    if stage.kv_cache != "auto":
        return f"{where} holds a {stage.kv_cache} KV cache; the compiled step covers only the unquantized cache"
    if stage.device.type != "cpu":
        return f"{where} is on {stage.device}; the compiled step is built and measured on a CPU only"
    if stage.dtype not in (torch.float32, torch.bfloat16):
        return f"{where} runs in {stage.dtype}; the compiled step covers fp32 and bf16"
    return None


class CompiledStep:
    """A chunk of up to ``max(ROWS)`` rows (a one-token step, a drafted verify chunk) through all
    layers of a stage, compiled; sessions of ``capacity`` tokens.

    Built by :meth:`Stage.enable_compiled` (or ``Stage.load(..., compile=True)``), which checks
    :func:`unsupported` first. :meth:`takes` says whether a chunk goes through it, :meth:`step`
    runs it; :meth:`Stage.forward` calls both for a lone session's chunk.
    """

    def __init__(self, stage: Stage, capacity: int, max_span: int | None = None,
                 rows: tuple[int, ...] = ROWS) -> None:
        if (why := unsupported(stage)) is not None:
            raise ModelError(why)
        if not 1 <= capacity <= stage.args.max_seq_len:
            raise ModelError(
                f"compiled capacity {capacity} outside 1..{stage.args.max_seq_len} (the model's positions)"
            )
        if not rows or rows[0] != 1 or list(rows) != sorted(set(rows)):
            raise ModelError(f"compiled row counts {rows}: ascending, distinct, starting at 1")
        self.capacity = capacity
        # chunks that would read a longer span run eagerly (takes): positions < longest
        self.longest = longest_span(capacity, max_span)
        self.rows = rows  # each chunk is padded up to the first of these that holds it
        self.layers = cast(list[llama_layers.DecoderLayer], list(stage.layers))
        largs = llama_layers.ModelArgs.from_config(stage.args.config)
        self.kv_heads, self.head_dim = largs.n_kv_heads, largs.head_dim
        self.dtype, self.device = stage.dtype, stage.device
        inv_freq = llama_layers.rope_inv_freq(largs)
        self._cos, self._sin = llama_layers.rope_tables(inv_freq, capacity, stage.dtype, stage.device)  # (C, hd)
        # every CompiledStep traces the same function, so dynamo keeps one cache for all of them:
        # stages of other layer counts, dtypes or capacities add their graphs to it
        global _graph_budget
        _graph_budget += n_spans(self.longest) * len(rows)
        dyn = cast(Any, torch._dynamo.config)
        if dyn.recompile_limit < _graph_budget + 2:  # and a margin for a guard we did not foresee
            dyn.recompile_limit = _graph_budget + 2
        with torch.inference_mode():  # the fixed input buffers, one per row count; inference tensors like a forward's
            self._x = {r: torch.zeros(1, r, stage.args.dim, dtype=stage.dtype, device=stage.device) for r in rows}
        self._fn = torch.compile(_decode, backend="inductor", fullgraph=True, dynamic=False)
        self.compiled_graphs: set[tuple[int, int]] = set()  # (span, rows) run so far (each compiled once per process)

    @property
    def compiled_spans(self) -> set[int]:
        """The spans run so far, at any row count."""
        return {span for span, _ in self.compiled_graphs}

    def bucket(self, rows: int) -> int | None:
        """The row count a chunk of ``rows`` rows is padded to (None: more than any)."""
        return next((r for r in self.rows if r >= rows), None)

    def takes(self, cache: KVCache, rows: int) -> bool:
        """Whether a chunk of ``rows`` rows at ``cache.length`` runs here: a cache of this
        capacity, a compiled row count that holds it, every real row's span compiled (positions
        < ``longest``) and the padded rows' writes inside the cache (< ``capacity``)."""
        b = self.bucket(rows)
        pos = cache.length
        return (b is not None and cache.max_len == self.capacity and pos + rows <= self.longest
                and pos + b <= self.capacity)

    def buffers(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This stage's (1, KV, capacity, hd) key and value buffers in ``cache``, allocated on
        first use (before any chunk wrote them, e.g. a one-token prompt)."""
        ks, vs = [], []
        for layer in self.layers:
            k, v = cache.allocate(layer.layer_idx, self.kv_heads, self.head_dim)
            ks.append(k)
            vs.append(v)
        return ks, vs

    @torch.inference_mode()
    def step(self, cache: KVCache, h: torch.Tensor) -> torch.Tensor:
        """h (T, D) at positions ``cache.length`` .. +T-1 -> (T, D); writes those positions' keys
        and values (and the padded rows', past ``cache.length`` once it has moved: never read)."""
        T = h.shape[0]
        if not self.takes(cache, T):
            raise ModelError(f"a compiled chunk of {T} rows at {cache.length} does not fit (rows {self.rows}, "
                             f"capacity {self.capacity}, compiled to {self.longest}, cache {cache.max_len}): run it eagerly")
        b = cast(int, self.bucket(T))
        pos = cache.begin(T)
        span = span_for(pos + T, self.capacity)
        ks, vs = self.buffers(cache)
        pos_t = torch.arange(pos, pos + b, dtype=torch.int64, device=self.device)  # (b,)
        x = self._x[b]  # (1, b, D): the same input tensor every chunk of this size
        x[0, :T].copy_(h)
        if b > T:
            x[0, T:].zero_()  # padded rows: finite, so a masked key's value times 0 stays 0
        out = self._fn(self.layers, x, self._cos, self._sin, pos_t, ks, vs, span)
        self.compiled_graphs.add((span, b))
        cache.advance(T)
        return cast(torch.Tensor, out)[0, :T]  # (T, D)


def _decode(
    layers: list[llama_layers.DecoderLayer],
    x: torch.Tensor,  # (1, T, D): T rows (padded ones last)
    cos_table: torch.Tensor,  # (C, hd)
    sin_table: torch.Tensor,  # (C, hd)
    pos: torch.Tensor,  # (T,) int64: the rows' positions, consecutive
    ks: list[torch.Tensor],  # per layer (1, KV, C, hd), written at pos
    vs: list[torch.Tensor],
    span: int,  # static: attention reads keys [0, span), those after a row's position masked
) -> torch.Tensor:
    """The eager DecoderLayer.forward (llama_layers.py), with the cache write and the key range
    made static: row i at position pos[i] sees keys 0..pos[i] (causal inside the chunk too).
    Traced by torch.compile; never called eagerly in production."""
    T = x.shape[1]
    cos = cos_table.index_select(0, pos)  # (T, hd)
    sin = sin_table.index_select(0, pos)
    visible = torch.arange(span, device=x.device)[None, :] <= pos[:, None]  # (T, span)
    for layer, k_buf, v_buf in zip(layers, ks, vs, strict=True):
        attn: Any = layer.self_attn
        h = layer.input_layernorm(x)  # (1, T, D)
        H, KV, hd, rep = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.n_rep
        q = llama_layers.apply_rope(attn.q_proj(h).reshape(1, T, H, hd).transpose(1, 2), cos, sin)  # (1, H, T, hd)
        k = llama_layers.apply_rope(attn.k_proj(h).reshape(1, T, KV, hd).transpose(1, 2), cos, sin)  # (1, KV, T, hd)
        v = attn.v_proj(h).reshape(1, T, KV, hd).transpose(1, 2)  # (1, KV, T, hd)
        k_buf.index_copy_(2, pos, k)
        v_buf.index_copy_(2, pos, v)
        # the eager decode packing, for T rows: the rep query heads sharing a KV head, each of
        # their T rows, as one sequence of rep*T queries (keys and values never repeated)
        qp = q.reshape(1, KV, rep * T, hd)  # (1, KV, rep*T, hd): row r*T + t is head r's row t
        mask = visible.repeat(rep, 1)[None, None]  # (1, 1, rep*T, span)
        out = F.scaled_dot_product_attention(
            qp, k_buf[:, :, :span], v_buf[:, :, :span], attn_mask=mask, scale=attn.scale
        )  # (1, KV, rep*T, hd)
        out = out.reshape(1, H, T, hd).transpose(1, 2).reshape(1, T, H * hd)
        x = x + attn.o_proj(out)
        x = x + cast(nn.Module, layer.mlp)(layer.post_attention_layernorm(x))  # (1, T, D)
    return x


def warm_compiled(stage: Stage, spans: int | None = None) -> list[int]:
    """Compile the graphs of the first ``spans`` spans (all the step runs by default: up to its
    ``longest``), each at every compiled row count, on a scratch session, so no user token pays
    compile time; returns the spans compiled. The scratch session's cache is one session's at
    capacity, freed before this returns (a node warms before it serves: no session is open).
    Inductor's kernels take the current ``torch.get_num_threads()``: set it first."""
    step = stage.compiled
    if step is None:
        raise ModelError(f"stage [{stage.start}, {stage.end}) was not built with compile=True")
    wanted: list[int] = []
    length = 1
    while spans is None or len(wanted) < spans:
        span = span_for(length, step.capacity)
        if not wanted or wanted[-1] != span:
            wanted.append(span)
        if length >= step.longest:
            break
        length = min(span + 1, step.longest)
    scratch = ("warm-compiled", id(stage))
    stage.open_session(scratch, step.capacity)
    try:
        cache = stage._cache(scratch)
        for span in wanted:
            for rows in step.rows:
                # a chunk of ``rows`` rows ending at the span's last position: this (span, rows)
                # graph; a span shorter than the rows is one no chunk can use (takes)
                if rows <= span:
                    cache.length = span - rows
                    step.step(cache, torch.zeros(rows, stage.args.dim, dtype=stage.dtype))
    finally:
        stage.close_session(scratch)
    return wanted
