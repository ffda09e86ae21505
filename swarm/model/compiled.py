"""A static-shape, compiled one-token decode step for a stage (issue 30, opt-in: ``--compile``).

Theory of operation
-------------------
On small models the eager decode step is dominated by Python dispatch: a layer of the bundled
SmolLM2-135M is a handful of tiny GEMMs, and each op pays torch's per-call overhead. This module
runs the *same* hand-written layer math (llama_layers.py: RMSNorm, RoPE, packed-GQA SDPA, SwiGLU)
for one token through all of a stage's layers as one ``torch.compile`` graph (inductor,
``fullgraph=True``, ``dynamic=False``), so the step costs one call and fused C++ kernels.

Static shapes, so that a growing session does not recompile at every token:

- The KV cache of a compiled stage is preallocated at one fixed ``capacity`` for every session
  (the cache's layout (1, KV, capacity, hd) is then the same tensor shape and strides for all
  sessions; the eager path uses the same buffers, so chunks, rollbacks and batches interleave
  with compiled steps freely).
- The position is a 0-d int64 tensor, not a Python int: the new key and value are written with
  ``index_copy_`` and the rotary row is an ``index_select`` of a (capacity, hd) table built once.
- Attention reads a *span* of the cache, the position rounded up to a power of two (at least
  ``MIN_SPAN``), with the keys past the position masked out. One graph per span, so a session of
  n tokens compiles at most ``1 + log2(n / MIN_SPAN)`` graphs, shared by all sessions.
  ``torch._dynamo``'s recompile limit is raised to that count (it defaults to 8).

No host syncs inside the step: nothing is read back to Python between layers.

What is promised: in fp32 the compiled step's greedy tokens equal the eager step's, dense or
int8/int4 (the tests check it on the bundled model, and with drafted verify chunks run eagerly between compiled
steps); the arithmetic differs only in summation order (fused kernels, the masked padded span),
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
caller runs eagerly. Only one-token steps are compiled: prefill and verify chunks, batches of
sessions (batched.py) and row groups (rows.py) keep the eager path.

Inductor's CPU kernels take the thread count at compile time: set ``torch.set_num_threads``
before :func:`warm_compiled` (the CLI does).

In a node (``join --compile``; node/compute/runtime.py ``Models._compile``): the capacity is the
swarm's context, the length every StageWorker session's cache already has (so a compiled stage
holds no more KV than an eager one, and the budget counts it as is), and only the spans up to
the node's ``compile_span`` (default :data:`LONGEST_SPAN`) are compiled before the block is
reported loaded; steps at later positions run eagerly, so no graph is ever compiled while
serving. The ring's contract with compiled stages: in fp32 its greedy tokens equal one eager
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
    """One-token decode through all layers of a stage, compiled; sessions of ``capacity`` tokens.

    Built by :meth:`Stage.enable_compiled` (or ``Stage.load(..., compile=True)``), which checks
    :func:`unsupported` first. ``step`` is the only entry; :meth:`Stage.forward` calls it for a
    one-token chunk of a session whose cache has this capacity.
    """

    def __init__(self, stage: Stage, capacity: int, max_span: int | None = None) -> None:
        if (why := unsupported(stage)) is not None:
            raise ModelError(why)
        if not 1 <= capacity <= stage.args.max_seq_len:
            raise ModelError(
                f"compiled capacity {capacity} outside 1..{stage.args.max_seq_len} (the model's positions)"
            )
        self.capacity = capacity
        # steps that would read a longer span run eagerly (Stage.forward): positions < longest
        self.longest = longest_span(capacity, max_span)
        self.layers = cast(list[llama_layers.DecoderLayer], list(stage.layers))
        largs = llama_layers.ModelArgs.from_config(stage.args.config)
        self.kv_heads, self.head_dim = largs.n_kv_heads, largs.head_dim
        self.dtype, self.device = stage.dtype, stage.device
        inv_freq = llama_layers.rope_inv_freq(largs)
        self._cos, self._sin = llama_layers.rope_tables(inv_freq, capacity, stage.dtype, stage.device)  # (C, hd)
        # every CompiledStep traces the same function, so dynamo keeps one cache for all of them:
        # stages of other layer counts, dtypes or capacities add their spans' graphs to it
        global _graph_budget
        _graph_budget += n_spans(self.longest)
        dyn = cast(Any, torch._dynamo.config)
        if dyn.recompile_limit < _graph_budget + 2:  # and a margin for a guard we did not foresee
            dyn.recompile_limit = _graph_budget + 2
        with torch.inference_mode():  # the fixed input buffer; an inference tensor like a forward's
            self._x = torch.zeros(1, 1, stage.args.dim, dtype=stage.dtype, device=stage.device)
        self._fn = torch.compile(_decode, backend="inductor", fullgraph=True, dynamic=False)
        self.compiled_spans: set[int] = set()  # spans run so far (each compiled once per process)

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
        """h (1, D) at position ``cache.length`` -> (1, D); writes that position's keys and values."""
        pos = cache.begin(1)
        span = span_for(pos + 1, self.capacity)
        ks, vs = self.buffers(cache)
        pos_t = torch.tensor([pos], dtype=torch.int64, device=self.device)  # (1,)
        self._x.copy_(h.reshape(1, 1, -1))  # (1, 1, D): the same input tensor every step
        out = self._fn(self.layers, self._x, self._cos, self._sin, pos_t, ks, vs, span)
        self.compiled_spans.add(span)
        cache.advance(1)
        return cast(torch.Tensor, out).reshape(1, -1)  # (1, D)


def _decode(
    layers: list[llama_layers.DecoderLayer],
    x: torch.Tensor,  # (1, 1, D)
    cos_table: torch.Tensor,  # (C, hd)
    sin_table: torch.Tensor,  # (C, hd)
    pos: torch.Tensor,  # (1,) int64: the new token's position
    ks: list[torch.Tensor],  # per layer (1, KV, C, hd), written at pos
    vs: list[torch.Tensor],
    span: int,  # static: attention reads keys [0, span), those after pos masked
) -> torch.Tensor:
    """The eager DecoderLayer.forward for T == 1 (llama_layers.py), with the cache write and the
    key range made static. Traced by torch.compile; never called eagerly in production."""
    cos = cos_table.index_select(0, pos)  # (1, hd)
    sin = sin_table.index_select(0, pos)
    visible = (torch.arange(span, device=x.device) <= pos)[None, None, None]  # (1, 1, 1, span)
    for layer, k_buf, v_buf in zip(layers, ks, vs, strict=True):
        attn: Any = layer.self_attn
        h = layer.input_layernorm(x)  # (1, 1, D)
        H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = llama_layers.apply_rope(attn.q_proj(h).reshape(1, 1, H, hd).transpose(1, 2), cos, sin)  # (1, H, 1, hd)
        k = llama_layers.apply_rope(attn.k_proj(h).reshape(1, 1, KV, hd).transpose(1, 2), cos, sin)  # (1, KV, 1, hd)
        v = attn.v_proj(h).reshape(1, 1, KV, hd).transpose(1, 2)  # (1, KV, 1, hd)
        k_buf.index_copy_(2, pos, k)
        v_buf.index_copy_(2, pos, v)
        qp = q.reshape(1, KV, attn.n_rep, hd)  # (1, KV, n_rep, hd): the eager decode packing
        out = F.scaled_dot_product_attention(
            qp, k_buf[:, :, :span], v_buf[:, :, :span], attn_mask=visible, scale=attn.scale
        )  # (1, KV, n_rep, hd)
        out = out.reshape(1, H, 1, hd).transpose(1, 2).reshape(1, 1, H * hd)
        x = x + attn.o_proj(out)
        x = x + cast(nn.Module, layer.mlp)(layer.post_attention_layernorm(x))  # (1, 1, D)
    return x


def warm_compiled(stage: Stage, spans: int | None = None) -> list[int]:
    """Compile the graphs of the first ``spans`` spans (all the step runs by default: up to its
    ``longest``) on a scratch session, so no user token pays compile time; returns the spans
    compiled. The scratch session's cache is one session's at capacity, freed before this
    returns (a node warms before it serves: no session is open). Inductor's kernels take the
    current ``torch.get_num_threads()``: set it first."""
    step = stage.compiled
    if step is None:
        raise ModelError(f"stage [{stage.start}, {stage.end}) was not built with compile=True")
    wanted: list[tuple[int, int]] = []  # (span, the first cache length that uses it)
    length = 1
    while spans is None or len(wanted) < spans:
        span = span_for(length, step.capacity)
        if not wanted or wanted[-1][0] != span:
            wanted.append((span, length))
        if length >= step.longest:
            break
        length = min(span + 1, step.longest)
    scratch = ("warm-compiled", id(stage))
    stage.open_session(scratch, step.capacity)
    try:
        cache = stage._cache(scratch)
        h = torch.zeros(1, stage.args.dim, dtype=stage.dtype)
        for _, length in wanted:
            cache.length = length - 1  # the step writes position length - 1: this span's graph
            step.step(cache, h)
    finally:
        stage.close_session(scratch)
    return [span for span, _ in wanted]
