"""``Stage``: decoder layers [start, end) with per-session KV caches; ``Head``: the coordinator part.

Theory of operation
-------------------
A model is a chain ``Head.embed -> Stage[0, a) -> Stage[a, b) -> ... -> Stage[z, L) -> Head.logits``.
Every stage sees hidden states (T, D) and returns hidden states (T, D); it never sees token ids
or logits. A stage holds one :class:`KVCache` per session (a generation), so several generations
share one copy of the weights. Positions are implicit: a forward of T rows on a session whose
cache holds ``n`` entries computes positions ``n .. n+T-1`` and appends T entries. To undo a
rejected speculative tail, ``rollback(session, n)`` forgets everything from position ``n`` on.

Because every stage appends exactly the rows it is given, the caches of all stages of a session
stay at the same length as long as each stage sees the same chunks; the chain of stages computes
exactly what one stage holding all layers would (the family tests check this against
transformers' ``generate`` for every split).

The layers are transformers' own (families.py): the family's ``XxxForCausalLM`` is built on the
meta device, the stage keeps ``model.layers[start:end]`` and loads only their tensors. Each layer
is called as the family's model forward calls it: ``position_embeddings`` from the model's rotary
module, an attention mask for its layer type (full causal or sliding window), the session's
cache. The Head keeps ``embed_tokens`` (Gemma's scaled embedding included), the final norm and
``lm_head`` (tied to the embedding where the config says so) and applies the family's final
logit soft-capping.

Two runtimes behind this one interface, because a measurement said so (llama_layers.py has the
figures): plain Llama / SmolLM / Qwen2 / unwindowed Mistral run the hand-written layers of
llama_layers.py (``runtime="handwritten"``), every other family, and any of those with a window
that can matter, runs transformers' layers (``runtime="transformers"``). Both append to the same
:class:`KVCache`; ``Stage(..., runtime=...)`` forces one (the benchmark compares them).

Threads: torch's intra-op thread count is a per-process setting; the process that owns stages
(CLI, node) calls ``torch.set_num_threads`` once. Nothing here changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from swarm.errors import ModelError, WeightsError
from swarm.model import families, llama_layers, rows
from swarm.model.capability import (
    choose_head_kernel,
    device_capability,
    dynamic_reduce_range,
    kv_format_problem,
    probe,
)
from swarm.model.config import ModelArgs
from swarm.model.kvcache import KVCache, check_kv_format
from swarm.model.quant import check_quant, linear_paths, quantize_block
from swarm.model.quant_dynamic import DynamicInt8
from swarm.model.quant_formats import Packed
from swarm.model.weights import TensorSource

if TYPE_CHECKING:
    from swarm.model.compiled import CompiledStep

Progress = Callable[[int, int], None]
LayerStep = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]  # (layer index, layer, x) -> x


class Stage(nn.Module):
    """Decoder layers ``[start, end)`` of one model, with independent per-session KV caches."""

    def __init__(
        self,
        args: ModelArgs,
        start: int,
        end: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        runtime: str | None = None,
        kv_cache: str = "auto",
    ) -> None:
        """Build an *unloaded* stage on the meta device; use :meth:`load` to get a usable one.

        ``runtime``: "handwritten" or "transformers"; by default the hand-written layers where
        ``llama_layers.supports`` the config, else transformers'. ``kv_cache``: how every
        session's KV cache holds keys and values (kvcache.KV_FORMATS; the swarm's invite key):
        ModelError where the device cannot hold that format (capability.kv_format_problem).
        """
        super().__init__()
        if not (0 <= start < end <= args.n_layers):
            raise ModelError(
                f"invalid layer range [{start}, {end}) for a model of {args.n_layers} layers"
            )
        self.args = args
        self.start = start
        self.end = end
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_cache = check_kv_format(kv_cache)
        if kv_cache != "auto" and (problem := kv_format_problem(probe(self.device), kv_cache)):
            raise ModelError(problem)
        handwritten_ok = llama_layers.supports(args.config)
        self.runtime = runtime or ("handwritten" if handwritten_ok else "transformers")
        if self.runtime not in ("handwritten", "transformers") or (self.runtime == "handwritten" and not handwritten_ok):
            raise ModelError(f"runtime {self.runtime!r} cannot run a {args.architecture} stage")
        self._model: list[Any] = []
        self.rows_exact_memo: dict[int, bool] = {}  # row count -> one-token steps as one pass exact here (rows.py)
        if self.runtime == "handwritten":
            largs = llama_layers.ModelArgs.from_config(args.config)
            with torch.device("meta"):
                self.layers = nn.ModuleList(llama_layers.DecoderLayer(largs, i) for i in range(start, end))
            self._inv_freq = llama_layers.rope_inv_freq(largs)
            self._cos = self._sin = torch.empty(0, args.head_dim, dtype=dtype, device=self.device)
        else:
            self.hf_config = families.hf_config(args.config, where=args.architecture)
            model = families.meta_model(self.hf_config, dtype)
            self.layers = nn.ModuleList(model.model.layers[start:end])
            self._model = [model]  # not a submodule: the rest of it stays on meta and is never loaded
            # not a submodule either, so that to_empty()/to(dtype) leave its float32 tables alone
            self._rotary = families.Rotary(model, self.device)
            self._eager = model.config._attn_implementation == "eager"  # additive float masks
        self._sessions: dict[Hashable, KVCache] = {}
        self._bound: nn.ModuleList | None = None
        self.quant = "none"  # set by load: how the linear layers are held (see swarm.model.quant)
        self._plan: list[tuple[nn.Module, int | None, str]] = []
        self.compiled: CompiledStep | None = None  # set by enable_compiled (compiled.py)
        self.released = False  # see release()

    @classmethod
    def load(
        cls,
        args: ModelArgs,
        source: TensorSource,
        start: int,
        end: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        progress: Progress | None = None,
        quant: str = "none",
        runtime: str | None = None,
        kernel_dtype: torch.dtype | None = None,
        kv_cache: str = "auto",
        compile: bool = False,
        compile_capacity: int | None = None,
    ) -> Stage:
        """Read only the tensors of layers [start, end) from ``source`` (WeightsError on trouble).

        Layers are loaded one at a time and, with ``quant`` int8/int4/mxfp4, converted on the host
        before the next is read, so loading never holds more than one layer in ``dtype`` beyond
        the compact rest, and a device only ever receives compact weights;
        a source with compact blocks (GGUF Q4_*) hands int4 groups to the hand-written layers
        without a float copy. ``kernel_dtype``: the dtype quantized linears are packed in where
        it is not ``dtype`` (quant.quantize_block; chosen by measurement in autotune.py).
        ``compile``: decode steps and verify chunks run compiled (:meth:`enable_compiled`, ModelError
        where the stage is not supported); call ``compiled.warm_compiled`` before serving.
        """
        check_quant(quant)
        stage = cls(args, start, end, dtype=dtype, device=device, runtime=runtime, kv_cache=kv_cache)
        stage.quant = quant
        compact = getattr(source, "compact", None) if quant != "none" else None
        try:
            stage._load_layers(source, progress, compact, kernel_dtype)
        except torch.OutOfMemoryError as exc:
            # drop what was loaded before anyone holds on to it (the traceback keeps this frame):
            # the node keeps serving its other work, and a smaller block may still fit
            stage.layers = nn.ModuleList()
            stage._model = []
            if stage.device.type == "cuda":
                torch.cuda.empty_cache()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            raise ModelError(
                f"out of memory on {stage.device} loading layers [{start}, {end}) of {args.architecture} "
                f"in {str(dtype).removeprefix('torch.')}{'' if quant == 'none' else ' ' + quant}: {first[:200]}; "
                "offer less memory (--memory) or hold fewer layers"
            ) from None
        stage._model = []  # drop the meta shell; the layers keep their loaded tensors
        stage.requires_grad_(False)
        stage.eval()
        if compile:
            stage.enable_compiled(compile_capacity)
        return stage

    def enable_compiled(self, capacity: int | None = None, max_span: int | None = None,
                        rows: tuple[int, ...] | None = None) -> None:
        """Run a lone session's one-token steps and small chunks (drafted verify chunks) through
        compiled static-shape graphs (compiled.py), a chunk padded up to one of ``rows``
        (default compiled.ROWS).

        Every session opened from now on holds a KV cache of ``capacity`` positions (default:
        the model's, capped at 4096), so all share the graphs; a session asking for more runs
        eagerly, and so do chunks reaching past ``max_span`` (compiled.longest_span; None:
        every span up to ``capacity`` is compiled). ModelError naming why where this stage is
        not supported (then run eagerly).
        """
        from swarm.model.compiled import ROWS, CompiledStep

        cap = capacity if capacity is not None else min(self.args.max_seq_len, 4096)
        self.compiled = CompiledStep(self, cap, max_span, ROWS if rows is None else rows)

    def _load_layers(self, source: TensorSource, progress: Progress | None, compact: Any,
                     kernel_dtype: torch.dtype | None) -> None:
        stage, start, end, dtype, quant = self, self.start, self.end, self.dtype, self.quant
        n = end - start
        # a layer to be made compact is read and converted on the host, and only its compact
        # form (and its small dense rest) goes to the device: a GPU never holds a layer's float
        # temporaries (gpt-oss-120B's experts are 6.4 GB per layer in bf16, a 4090 has 24)
        host = torch.device("cpu") if quant != "none" else stage.device
        for done, i in enumerate(range(start, end), 1):  # one layer at a time: bounded peak memory
            prefix = f"model.layers.{i}."
            names = families.tensor_names(source, [prefix])
            given: dict[str, Any] = {}
            layer = stage.layers[i - start]
            if stage._model:
                model = stage._model[0]
                families.load_modules(model, source, names, {prefix: model.model.layers[i]}, dtype, host)
            else:
                given = _load_handwritten(layer, source, prefix, names, dtype, host, compact, quant)
            quantize_block(layer, quant, dtype=dtype, given=given, device=stage.device, kernel_dtype=kernel_dtype)
            if host != stage.device:
                layer.to(stage.device)  # the dense rest: norms, biases, routers, attention under mxfp4
            if progress is not None:
                progress(done, n)

    def release(self) -> None:
        """Let go of this stage's weights and every session's KV cache now, whoever still holds the
        Stage (a worker of an ended epoch, until its task unwinds): a re-plan that moves a block
        releases the old one before it loads the new one (node/compute/runtime.py), so a peer
        never holds both. A forward already running keeps what it uses until it returns; any
        later call finds no session (ModelError)."""
        self._sessions.clear()
        self.layers = nn.ModuleList()
        self._plan, self._bound, self._model = [], None, []
        self.compiled = None
        self.released = True

    # ------------------------------------------------------------------------- sessions
    def open_session(self, session: Hashable, max_len: int) -> None:
        """Make a KV cache for ``max_len`` positions (ModelError if the session exists)."""
        if self.released:
            raise ModelError(f"stage [{self.start}, {self.end}) was released (a re-plan moved its block)")
        if session in self._sessions:
            raise ModelError(f"session {session!r} is already open on stage [{self.start}, {self.end})")
        if max_len > self.args.max_seq_len:
            raise ModelError(
                f"max_len {max_len} exceeds the model's max_position_embeddings {self.args.max_seq_len}"
            )
        if self.compiled is not None and max_len <= self.compiled.capacity:
            max_len = self.compiled.capacity  # one cache shape for every session: no recompiles
        self._sessions[session] = KVCache(max_len, dtype=self.dtype, device=self.device, kv_cache=self.kv_cache)

    def close_session(self, session: Hashable) -> None:
        """Free a session's cache; closing an unknown session is a no-op (idempotent)."""
        self._sessions.pop(session, None)

    def session_len(self, session: Hashable) -> int:
        return self._cache(session).length

    def rollback(self, session: Hashable, length: int) -> None:
        """Forget positions >= ``length`` of ``session`` (O(1))."""
        self._cache(session).rollback(length)

    def sessions(self) -> list[Hashable]:
        return list(self._sessions)

    def kv_bytes(self) -> int:
        """What every open session's KV cache holds now, in bytes (allocated as a chunk first needs it)."""
        return sum(c.nbytes() for c in self._sessions.values())

    def _cache(self, session: Hashable) -> KVCache:
        c = self._sessions.get(session)
        if c is None:
            raise ModelError(f"no session {session!r} open on stage [{self.start}, {self.end})")
        return c

    # ------------------------------------------------------------------------- compute
    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < length:
            n = max(length, min(2 * self._cos.shape[0], self.args.max_seq_len))
            self._cos, self._sin = llama_layers.rope_tables(self._inv_freq, n, self.dtype, self.device)
        return self._cos, self._sin

    def _layer_plan(self) -> list[tuple[nn.Module, int | None, str]]:
        """(layer, attention window, layer type) per layer, from each layer's own index."""
        if self._bound is not self.layers:
            plan = []
            for layer in self.layers:
                idx = int(cast(Any, layer).self_attn.layer_idx)
                plan.append((layer, families.layer_window(self.hf_config, idx), families.layer_type(self.hf_config, idx)))
            self._plan, self._bound = plan, self.layers
        return self._plan

    def _mask(self, pos: int, T: int, window: int | None) -> torch.Tensor | None:
        """(1, 1, T, pos+T) mask for queries pos..pos+T-1, or None where none is needed."""
        end = pos + T
        in_window = window is None or end <= window
        if in_window and (T == 1 or (pos == 0 and not self._eager)):
            return None  # one query sees every key; or sdpa's is_causal from an empty cache
        q = torch.arange(pos, end, device=self.device)[:, None]
        k = torch.arange(end, device=self.device)[None, :]
        allowed = k <= q
        if window is not None:
            allowed &= k > q - window  # masking_utils.sliding_window_overlay
        allowed = allowed[None, None]  # (1, 1, T, L)
        if not self._eager:
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def _check_rows(self, h: torch.Tensor) -> None:
        if h.dim() != 2 or h.shape[1] != self.args.dim or h.shape[0] == 0:
            raise ModelError(
                f"stage [{self.start}, {self.end}) expects hidden states (T, {self.args.dim}) "
                f"with T >= 1, got {tuple(h.shape)}"
            )

    @torch.inference_mode()
    def forward(self, session: Hashable, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """h (T, D) at positions session_len .. session_len+T-1 -> (T, D); appends T cache entries."""
        cache = self._cache(session)
        self._check_rows(h)
        T = h.shape[0]
        step = self.compiled
        if step is not None and step.takes(cache, T):
            return step.step(cache, h)  # (T, D)
        (out,) = self._walk([[(cache, cache.begin(T), h)]])
        cache.advance(T)
        return out  # (T, D)

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[tuple[Hashable, torch.Tensor]]) -> list[torch.Tensor]:
        """``[(session, h (T_i, D)), ...]`` of distinct sessions -> ``[(T_i, D), ...]``, appending
        T_i entries to each session's cache as :meth:`forward` does: the sessions' rows go through
        each layer as one pass (``DecoderLayer.forward_rows``), attention per session; rows may
        differ from :meth:`forward`'s in the last bits (batched.py, which decides when to batch).
        The hand-written layers only (transformers' layers take one chunk a call)."""
        if self.runtime != "handwritten":
            raise ModelError(f"stage [{self.start}, {self.end}) runs transformers' layers: one session a forward")
        if len({s for s, _ in items}) != len(items):
            raise ModelError(f"forward_batch: a session appears twice in one batch ({[s for s, _ in items]})")
        chunks = []
        for session, h in items:
            self._check_rows(h)
            cache = self._cache(session)
            chunks.append((cache, cache.begin(h.shape[0]), h))
        outs = self._walk([chunks])
        for cache, _, h in chunks:
            cache.advance(h.shape[0])
        return outs

    @torch.inference_mode()
    def forward_seq(self, session: Hashable, chunks: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """Consecutive chunks ``[(pos, h (T, D)), ...]`` of one session -> ``[(T, D), ...]``: bit for
        bit what ``rollback(pos)`` then ``forward(h)`` per chunk in turn gives, cache included.

        The hand-written layers run it layer by layer (every chunk through one layer, then the
        next): each layer call is the same operation on the same inputs as chunk by chunk (a
        chunk at layer l attends to what the chunks before it wrote at layer l, written first in
        either order), so the numbers are the same, and one layer's weights stay hot for the
        whole group (a replay after a re-plan: about 25% less time for one-token chunks through
        19 layers of the bundled model). Small chunks go through a layer together, as one pass,
        where that is proven bit for bit on this machine (rows.py). Each chunk must start within what the ones before hold.
        """
        cache = self._cache(session)
        held = cache.length
        for pos, h in chunks:
            if h.dim() != 2 or h.shape[1] != self.args.dim or h.shape[0] == 0:
                raise ModelError(f"stage [{self.start}, {self.end}): a chunk of shape {tuple(h.shape)}")
            if not 0 <= pos <= held or pos + h.shape[0] > cache.max_len:
                raise ModelError(f"stage [{self.start}, {self.end}): a chunk at {pos} with {held} positions held")
            held = pos + h.shape[0]
        if self.runtime != "handwritten" or len(chunks) == 1:
            outs = []
            for pos, h in chunks:
                cache.rollback(pos)
                outs.append(self.forward(session, h))
            return outs
        units = rows.row_units(self, chunks)  # chunks merged into one pass where proven exact (rows.py)
        outs = self._walk([[(cache, *chunks[k]) for k in unit] for unit in units])
        cache.length = held
        return outs

    def _walk(self, units: list[list[tuple[KVCache, int, torch.Tensor]]]) -> list[torch.Tensor]:
        """The one layer loop: units of chunks ``(cache, pos, h (T, D))`` -> each chunk's (T, D), in
        order. Every unit goes through a layer before any goes through the next (a replay keeps a
        layer's weights hot; one unit is a plain forward). A unit of several chunks is one pass of
        their rows (hand-written layers: ``DecoderLayer.forward_rows``); a chunk writes its cache
        at ``pos`` (``KVCache.at``); moving each cache's length is the caller's."""
        xs, steps = [], []
        for unit in units:
            hs = [h.to(device=self.device, dtype=self.dtype) for _, _, h in unit]
            xs.append((hs[0] if len(hs) == 1 else torch.cat(hs)).unsqueeze(0))  # (1, R, D)
            steps.append(self._layer_step(unit))
        for i, layer in enumerate(self.layers):
            for u, step in enumerate(steps):
                xs[u] = step(i, layer, xs[u])  # (1, R, D)
        outs: list[torch.Tensor] = []
        for unit, x in zip(units, xs, strict=True):
            outs.extend([x[0]] if len(unit) == 1 else torch.split(x[0], [h.shape[0] for _, _, h in unit]))
        return outs  # [(T, D)]

    def _layer_step(self, unit: list[tuple[KVCache, int, torch.Tensor]]) -> LayerStep:
        """How one unit goes through layer i: its rotary rows, masks and positions, made once."""
        if self.runtime == "handwritten":
            spans = []
            for cache, pos, h in unit:  # each chunk's rotary tables, taken in turn as forward() takes them
                end = pos + h.shape[0]
                cos, sin = self._rope_tables(end)
                spans.append(llama_layers.Span(cache, pos, cos[pos:end], sin[pos:end]))  # (T, hd) x2
            return lambda i, layer, x: cast(llama_layers.DecoderLayer, layer).forward_rows(x, spans)
        if len(unit) != 1:
            raise ModelError(f"stage [{self.start}, {self.end}) runs transformers' layers: one chunk a pass")
        ((cache, pos, h),) = unit
        T = h.shape[0]
        plan = self._layer_plan()
        position_ids = torch.arange(pos, pos + T, device=self.device)[None]  # (1, T)
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[int | None, torch.Tensor | None] = {}

        def step(i: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            _, window, kind = plan[i]
            if kind not in rope:
                rope[kind] = self._rotary(x, position_ids, kind)
            if window not in masks:
                masks[window] = self._mask(pos, T, window)
            cache.at(pos, T)
            y = layer(
                x, attention_mask=masks[window], position_embeddings=rope[kind],
                position_ids=position_ids, cache=cache, use_cache=True,
            )
            return cast(torch.Tensor, y[0] if isinstance(y, tuple) else y)

        return step


def _load_handwritten(
    layer: nn.Module, source: TensorSource, prefix: str, names: list[str], dtype: torch.dtype,
    device: torch.device, compact: Callable[[str, str], Any] | None, quant: str,
) -> dict[str, Any]:
    """Assign one hand-written layer's tensors, each checked against the shape config.json implies;
    return the compact int4 groups a GGUF source handed over instead (for quantize_block)."""
    want = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    have = {n[len(prefix):]: n for n in names}
    linears = set(linear_paths(layer))
    sd: dict[str, torch.Tensor] = {}
    given: dict[str, Any] = {}
    for key, shape in want.items():
        name = have.get(key, prefix + key)
        packed = None
        if compact is not None and key.endswith(".weight") and key[: -len(".weight")] in linears:
            packed = compact(name, quant)
        got = tuple(packed.q.shape) if packed is not None else tuple(source.shape(name))  # names a missing file
        if got != shape:
            raise WeightsError(
                f"{source.path}: tensor {name} has shape {list(got)} but config.json implies {list(shape)}"
            )
        if packed is not None:
            given[key[: -len(".weight")]] = packed
            sd[key] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            sd[key] = source.load(name, dtype, device)
    layer.load_state_dict(sd, strict=True, assign=True)
    return given


class Head(nn.Module):
    """Embedding, final norm and LM head: what the coordinator holds (no decoder layers)."""

    def __init__(
        self, args: ModelArgs, embed_tokens: nn.Module, norm: nn.Module, lm_head: nn.Module, softcap: float | None
    ) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = embed_tokens  # (V, D), Gemma's scaled embedding included
        self.norm = norm
        self.lm_head = lm_head  # weight tied to embed_tokens.weight where the config says so
        self.tied = self.lm_head.weight is self.embed_tokens.weight
        self.softcap = softcap
        self.head_packed: Packed | None = None  # the LM head held int8 (hold_head_int8), else dense
        self.head_dynamic: DynamicInt8 | None = None  # ... or int8 through fbgemm (kernel fbgemm_dynamic)

    @property
    def head_quant(self) -> str:
        """How :meth:`logits` multiplies by the LM head: "int8" or "none" (dense)."""
        return "none" if self.head_packed is None and self.head_dynamic is None else "int8"

    @property
    def head_kernel(self) -> str:
        """The int8 head's kernel (capability.head_kernel), "none" for a dense head."""
        if self.head_dynamic is not None:
            return "fbgemm_dynamic"
        return "none" if self.head_packed is None else self.head_packed.kernel

    def hold_head_int8(self, kernel: str | None = None) -> None:
        """Multiply by an int8 copy of the LM head (per-row symmetric, quant_formats.int8_from_float)
        through ``kernel`` (default: the device's, capability.choose_head_kernel) instead of the
        dense weight. The dense weight stays: the embedding reads it where the two are tied (a tied
        head then costs V*K more bytes), and drafters copy it. ``head_qweight`` (V, K) and
        ``head_scales`` (V,) are the integers and scales where the kernel reads them as tensors;
        fbgemm's ``head_dynamic`` holds its own packed blocks."""
        w = cast(torch.Tensor, self.lm_head.weight)
        kernel = kernel or choose_head_kernel(w.device, w.dtype)
        if kernel == "fbgemm_dynamic":  # packed a block of rows at a time (quant_dynamic.BLOCK_ROWS)
            reduce_range = dynamic_reduce_range(device_capability(w.device))
            self.head_dynamic = DynamicInt8.from_float(w, w.dtype, reduce_range=reduce_range)
            return
        spec, q, s = Packed.int8(w, w.dtype, w.device, kernel=kernel)
        self.register_buffer("head_qweight", q, persistent=False)
        self.register_buffer("head_scales", s, persistent=False)
        self.head_packed = spec

    @classmethod
    def load(
        cls,
        args: ModelArgs,
        source: TensorSource,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> Head:
        """Read only the embedding, final norm and LM head (a tied head reuses the embedding).

        The modules are the family's own (transformers'), except where the hand-written layers
        run the stages: there plain ``nn.Embedding``/RMSNorm/``nn.Linear`` do the same arithmetic
        without importing transformers (a node's start-up stays as quick as it was).
        """
        dev = torch.device(device)
        if llama_layers.supports(args.config):
            return _handwritten_head(args, source, dtype, dev)
        model = families.meta_model(families.hf_config(args.config, where=args.architecture), dtype)
        targets: dict[str, nn.Module] = {"model.embed_tokens.": model.model.embed_tokens, "model.norm.": model.model.norm}
        prefixes = list(targets)
        if not args.tie_word_embeddings:
            targets["lm_head."] = model.lm_head
            prefixes.append("lm_head.")
        names = families.tensor_names(source, prefixes)
        families.load_modules(model, source, names, targets, dtype, dev)
        families.tie_head(model)
        head = cls(args, model.model.embed_tokens, model.model.norm, model.lm_head, families.final_softcap(model.config))
        return head.requires_grad_(False).eval()

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> (T, D) in the model dtype."""
        if ids.dim() != 1:
            raise ModelError(f"embed expects token ids of shape (T,), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.args.vocab_size):
            raise ModelError(f"token id out of range [0, {self.args.vocab_size}) in {ids.tolist()}")
        weight = cast(torch.Tensor, self.embed_tokens.weight)
        return self.embed_tokens(ids.to(weight.device))  # type: ignore[no-any-return]

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (T, D) -> (T, V) float32, computed in the model dtype and then upcast (as HF does).

        Pass only the rows you need (e.g. ``h[-1:]`` after a prefill): that is both cheaper and
        what transformers' ``generate`` computes, so greedy ties resolve identically.
        """
        w = cast(torch.Tensor, self.lm_head.weight)
        x = self.norm(h.to(device=w.device, dtype=w.dtype)[None])  # (1, T, D)
        if self.head_dynamic is not None:
            out = self.head_dynamic.matmul(x[0])  # (T, V) float32: the activation rows quantized together
        elif self.head_packed is None:
            out = self.lm_head(x)[0]  # (T, V)
        else:
            q, s = cast(torch.Tensor, self.head_qweight), cast(torch.Tensor, self.head_scales)
            out = self.head_packed.matmul(x[0], q, s)  # (T, V)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out.float()


def _handwritten_head(args: ModelArgs, source: TensorSource, dtype: torch.dtype, device: torch.device) -> Head:
    def checked(name: str, shape: tuple[int, ...]) -> nn.Parameter:
        got = tuple(source.shape(name))
        if got != shape:
            raise WeightsError(f"{source.path}: tensor {name} has shape {list(got)} but config.json implies {list(shape)}")
        return nn.Parameter(source.load(name, dtype, device), requires_grad=False)

    V, D = args.vocab_size, args.dim
    largs = llama_layers.ModelArgs.from_config(args.config)
    with torch.device("meta"):
        embed, norm = nn.Embedding(V, D), llama_layers.RMSNorm(D, largs.norm_eps)
        lm_head = nn.Linear(D, V, bias=False)
    embed.weight = checked("model.embed_tokens.weight", (V, D))
    norm.weight = checked("model.norm.weight", (D,))
    lm_head.weight = embed.weight if args.tie_word_embeddings else checked("lm_head.weight", (V, D))
    return Head(args, embed, norm, lm_head, None).requires_grad_(False).eval()
