"""A MoE layer's experts kept compact: one packed int8/int4 weight per expert and projection.

Theory of operation
-------------------
transformers stores a MoE layer's experts as fused 3-D parameters (Mixtral, Qwen3-MoE,
DeepSeek-V3, GLM-4.5: ``gate_up_proj`` (E, 2I, D) and ``down_proj`` (E, D, I); gpt-oss the same
transposed, (E, D, 2I) and (E, I, D), with biases and interleaved gate/up columns). They are most
of a MoE model's bytes, and no ``nn.Linear``, so they need their own compact form.

``QuantExperts.from_experts(experts, kind)`` quantizes (int8, int4) or encodes (mxfp4) every expert's slice of each projection
separately (so each expert gets its own per-channel or per-group scales, exactly as a linear
layer of that shape would) with the same formats and torch kernels as linear layers
(quant_formats.Packed), and stacks the packed tensors along the expert axis: every expert of a
projection has one shape, hence one kernel and one layout, and expert ``e`` multiplies by
``qweight[e]``, a contiguous slice.

The forward is the family's own computation over the experts a chunk hits (as transformers' eager
experts forward, without its per-expert host syncs: see ``forward``): rows routed to expert ``e`` go through its gate/up projection, the family's
gate (``_apply_gate`` of the original module, which transformers' ``use_experts_implementation``
gives every experts class: SiLU-and-multiply, or gpt-oss's clamped SwiGLU on interleaved
columns), its down projection, and are weighted and summed into their token's row. The original
module, stripped of its 3-D weights, is kept as ``base`` for that gate, its activation and its
biases.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from swarm.errors import ConfigError
from swarm.model.quant_formats import INT4_GROUP, Packed, pack

# the fused 3-D weights transformers' experts classes hold (gate_up_proj, or up_proj without a gate)
_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts class with fused 3-D weights."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "is_transposed")


def experts_paths(module: nn.Module) -> list[str]:
    """Dotted names of the experts modules inside ``module`` (what quantize_block replaces)."""
    return [name for name, m in module.named_modules() if is_experts(m)]


def expert_shapes(experts: nn.Module) -> list[tuple[int, int, int]]:
    """(experts, out, in) of each fused projection: what a compact copy holds per expert."""
    out = []
    for name in _PROJECTIONS:
        w = getattr(experts, name, None)
        if isinstance(w, nn.Parameter) and w.dim() == 3:
            e, a, b = w.shape
            out.append((e, b, a) if experts.is_transposed else (e, a, b))
    return out


class QuantExperts(nn.Module):
    """Compact experts: ``{proj}_qweight`` (E, ...) and ``{proj}_scales`` (E, ...) buffers per fused
    projection, multiplied per expert by the torch kernel of ``layouts[proj]``; see the module doc."""

    def __init__(self, base: nn.Module, layouts: dict[str, Packed]) -> None:
        super().__init__()
        self.base = base  # the family's experts module without its 3-D weights: gate, act_fn, biases
        self.layouts = layouts
        self.num_experts = int(cast(Any, base).num_experts)

    @classmethod
    def from_experts(
        cls, experts: nn.Module, kind: str, *, dtype: torch.dtype | None = None, group: int = INT4_GROUP,
        device: torch.device | None = None,
    ) -> QuantExperts:
        """Quantize ``experts`` (a transformers experts module, loaded) expert by expert, onto
        ``device`` (default: where its weights are)."""
        ex = cast(Any, experts)
        if getattr(ex, "has_post_expert_norm", False):
            raise ConfigError(f"{type(experts).__name__}: experts with a norm after each expert cannot be quantized yet")
        if getattr(ex, "_is_expert_parallel", False):
            raise ConfigError(f"{type(experts).__name__}: expert-parallel experts cannot be quantized")
        packed: dict[str, tuple[Packed, torch.Tensor, torch.Tensor]] = {}
        for name in _PROJECTIONS:
            w = getattr(experts, name, None)
            if not (isinstance(w, nn.Parameter) and w.dim() == 3):
                continue
            if w.device.type == "meta" and (device is None or device.type != "meta"):
                raise ConfigError(f"{type(experts).__name__}.{name}: weight not loaded (on the meta device)")
            dt = dtype or w.dtype
            parts = []
            for e in range(w.shape[0]):  # one expert at a time: (N, K) in nn.Linear's orientation
                we = w[e].detach()
                parts.append(pack(we.T if ex.is_transposed else we, kind, dt, device or w.device, group))
            spec = parts[0][0]
            packed[name] = (spec, torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts]))
            delattr(experts, name)
            del parts, w
        m = cls(experts, {name: p[0] for name, p in packed.items()})
        for name, (_, qweight, scales) in packed.items():
            m.register_buffer(f"{name}_qweight", qweight)
            m.register_buffer(f"{name}_scales", scales)
        return m

    def _project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Rows x (T, K) through expert ``e``'s projection ``name`` (its bias added) -> (T, N)."""
        qweight, scales = getattr(self, f"{name}_qweight"), getattr(self, f"{name}_scales")
        y = self.layouts[name].matmul(x, qweight[e], scales[e])
        bias = getattr(self.base, f"{name}_bias", None) if cast(Any, self.base).has_bias else None
        return y if bias is None else y + bias[e]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (T, D), top_k_index (T, k) expert ids, top_k_weights (T, k) -> (T, D).

        The (token, slot) assignments are sorted by expert (stably, so each expert sees its rows
        in the order transformers' loop gives them, and experts are summed in ascending order as
        there) and counted on the device; the counts are the one transfer to the host per layer.
        Each hit expert then takes a contiguous slice of the sorted assignments: no per-expert
        ``where``/``unique``, so no host sync per expert."""
        base = cast(Any, self.base)
        out = torch.zeros_like(hidden_states)  # (T, D)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)  # (T*k,): assignment t*k + j
        ids = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)  # sentinels last
        order = torch.argsort(ids, stable=True)  # (T*k,) grouped by expert
        counts = torch.zeros(self.num_experts + 1, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))  # no bincount: it syncs on CUDA
        hits = counts.tolist()  # the one host transfer of this layer: (E + 1) counts
        weights = top_k_weights.reshape(-1)  # (T*k,)
        start = 0
        for e, n in enumerate(hits[: self.num_experts]):
            if n == 0:
                continue
            sel = order[start : start + n]  # (n,) assignments routed to expert e
            start += n
            token_idx = sel // k
            x = hidden_states[token_idx]  # (n, D)
            if base.has_gate:
                h = base._apply_gate(self._project("gate_up_proj", e, x))  # (n, I)
            else:
                h = base.act_fn(self._project("up_proj", e, x))
            y = self._project("down_proj", e, h) * weights[sel, None]  # (n, D)
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def dequantized(self, name: str) -> torch.Tensor:
        """Projection ``name`` of every expert as (E, N, K) float32 (tests)."""
        spec = self.layouts[name]
        qweight, scales = getattr(self, f"{name}_qweight"), getattr(self, f"{name}_scales")
        return torch.stack([spec.dequantized(qweight[e], scales[e]) for e in range(self.num_experts)])

    @property
    def kernels(self) -> dict[str, str]:
        return {name: spec.kernel for name, spec in self.layouts.items()}

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: {s.kind} {s.n}x{s.k} x{self.num_experts} ({s.kernel})" for n, s in self.layouts.items())
