"""Hand-written Llama-family layers: the faster runtime for plain Llama / SmolLM / Qwen2 / Mistral.

Why a second runtime exists beside transformers' layers (families.py): benchmarks/bench_runtime.py
(``layers_vs_handwritten``, benchmarks/results/runtime_layers.json) measured transformers' decoder
layers 6-10% slower than these on the bundled SmolLM2-135M for a one-token decode step (bf16 and
fp32, 1 thread, paired medians of three runs on a loaded 2-core AVX2 machine; -1% to +7% on verify
chunks): at hidden 576 a layer is only a few small GEMMs, and transformers' per-layer
Python (kwargs, deprecation wrappers, attention dispatch) is a measurable share of it. The issue's
rule is "within 5% or keep both", so ``Stage`` runs these layers where they are exact
(:func:`supports`: silu SwiGLU, RMSNorm, default or llama3 rope, no sliding window in use, Qwen2's
q/k/v biases) and transformers' layers for everything else. Both write to the same per-session
:class:`~swarm.model.kvcache.KVCache`; the golden tests prove both against transformers.

Theory of operation
-------------------
Each op mirrors the arithmetic of the Hugging Face reference step for step (same dtypes, same
order), because greedy decoding only reproduces the reference token-for-token if the logits
agree to the last bit or at least never swap the arg-max:

- RMSNorm upcasts to float32, normalises, casts back, *then* multiplies by the weight.
- RoPE frequencies and cos/sin are computed in float32 and cast to the model dtype; the tables
  are elementwise in the position, so precomputing them for 0..N-1 gives the same numbers as
  computing them per call.
- Attention has three shapes, picked per call:
    * one query token (decode, the hot path): GQA queries are packed as (KV, n_rep) so keys and
      values are never repeated and no mask is needed;
    * a chunk starting at position 0 (prefill): ``is_causal=True``;
    * a chunk appended after a non-empty cache (chunked prefill, speculative verify): an
      explicit boolean mask ``key_pos <= query_pos`` (SDPA's ``is_causal`` aligns top-left,
      which would be wrong here), keys and values repeated per query head.
- Tensors carry a leading batch dimension of 1 inside a layer, as the reference does, so GEMMs
  see the same shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelArgs:
    """What these layers need from config.json (checked by :func:`supports` first)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> ModelArgs:
        rs = c.get("rope_scaling")
        heads = c["num_attention_heads"]
        return cls(
            dim=c["hidden_size"], n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"], norm_eps=float(c.get("rms_norm_eps") or 1e-6),
            rope_theta=float(c.get("rope_theta") or 10000.0),
            rope_scaling=rs if rs and rs.get("rope_type", rs.get("type")) == "llama3" else None,
            qkv_bias=_arch(c) == "qwen2",
        )


def _arch(c: dict[str, Any]) -> str | None:
    for a in c.get("architectures") or []:
        if a in _ARCHS:
            return _ARCHS[a]
    return None


def supports(c: dict[str, Any]) -> bool:
    """True when these layers compute exactly what transformers' would for config ``c``."""
    arch = _arch(c)
    if arch is None or c.get("hidden_act", "silu") != "silu" or c.get("mlp_bias"):
        return False
    if arch != "qwen2" and c.get("attention_bias"):
        return False
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
    if kind not in (None, "default", "llama3"):
        return False
    if kind == "llama3" and isinstance(rs, dict) and not all(
        k in rs for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    ):
        return False
    window = None if arch == "llama" else c.get("sliding_window")
    if arch == "qwen2" and not c.get("use_sliding_window"):
        window = None
    # a window no shorter than the longest possible context never masks anything
    return window is None or window >= c.get("max_position_embeddings", 2048)


def sliding_window(c: dict[str, Any]) -> int | None:
    """The window config.json declares for these families (None: none)."""
    arch = _arch(c)
    if arch == "mistral":
        return c.get("sliding_window")
    if arch == "qwen2" and c.get("use_sliding_window"):
        return c.get("sliding_window")
    return None


def sizes(c: dict[str, Any]) -> tuple[list[int], int, int, int, list[list[tuple[int, int, int]]]]:
    """What ``families`` measures on the meta model, counted without transformers: per-layer
    parameter counts, embedding, final norm, untied lm_head, and each layer's (1, out, in) linears."""
    a = ModelArgs.from_config(c)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    linears = [(q, a.dim), (kv, a.dim), (kv, a.dim), (a.dim, q)]
    linears += [(a.intermediate_size, a.dim), (a.intermediate_size, a.dim), (a.dim, a.intermediate_size)]
    layer = sum(n * k for n, k in linears) + 2 * a.dim + ((q + 2 * kv) if a.qkv_bias else 0)
    vocab = c["vocab_size"]
    head = 0 if c.get("tie_word_embeddings") else vocab * a.dim
    n = c["num_hidden_layers"]
    return [layer] * n, vocab * a.dim, a.dim, head, [[(1, o, i) for o, i in linears] for _ in range(n)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) float32, with llama3 scaling when configured."""
    dim = args.head_dim
    inv = 1.0 / (
        args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    )
    rs = args.rope_scaling
    if rs is None:
        return inv
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    inv_scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_scaled / factor + smooth * inv_scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_scaled)


def rope_tables(
    inv_freq: torch.Tensor, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (length, head_dim) for positions 0..length-1, cast to ``dtype``."""
    pos = torch.arange(length, dtype=torch.int64, device=device).to(torch.float32)
    freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]  # (N, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (1, H, T, hd); cos/sin (T, hd)."""
    return (x * cos) + (_rotate_half(x) * sin)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        q_out = args.n_heads * args.head_dim
        kv_out = args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, q_out, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_out, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (1, T, D)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,  # (T, hd)
        cache: Any,  # KVCache: update() writes this chunk and returns all keys/values so far
        layer_idx: int,
        pos: int,
    ) -> torch.Tensor:
        out = self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, cache, layer_idx, pos)
        return self.o_proj(out)  # (1, T, D)

    def attend(
        self,
        q: torch.Tensor,  # (1, T, H*hd): this chunk's projected queries, before rotary
        k: torch.Tensor,  # (1, T, KV*hd)
        v: torch.Tensor,  # (1, T, KV*hd)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,  # (T, hd)
        cache: Any,  # KVCache: update() writes this chunk and returns all keys/values so far
        layer_idx: int,
        pos: int,
    ) -> torch.Tensor:
        """Attention between the projections: rotary, the cache, SDPA -> (1, T, H*hd). The one
        implementation of it: the forward above, several sessions in one pass (batched.py) and
        several steps of one session in one pass (rows.py) all call it, per chunk."""
        _, T, _ = q.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(q.reshape(1, T, H, hd).transpose(1, 2), cos, sin)  # (1, H, T, hd)
        k = apply_rope(k.reshape(1, T, KV, hd).transpose(1, 2), cos, sin)  # (1, KV, T, hd)
        v = v.reshape(1, T, KV, hd).transpose(1, 2)  # (1, KV, T, hd)
        end = pos + T
        keys, values = cache.update(k, v, layer_idx)  # (1, KV, L, hd)
        if T == 1:
            # decode: pack the n_rep query heads that share a KV head as a length-n_rep "sequence"
            qp = q.reshape(1, KV, self.n_rep, hd)  # (1, KV, n_rep, hd)
            out = F.scaled_dot_product_attention(qp, keys, values, scale=self.scale)
            out = out.reshape(1, H, 1, hd)  # (1, H, 1, hd)
        elif pos == 0:
            # prefill from an empty cache: top-left causal alignment is correct
            native = self.n_rep > 1 and q.device.type in _NATIVE_GQA
            if self.n_rep > 1 and not native:
                keys = _repeat_kv(keys, self.n_rep)
                values = _repeat_kv(values, self.n_rep)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale, enable_gqa=native)
        else:
            # chunk after a cache: query i sits at pos+i and sees keys 0..pos+i
            qpos = torch.arange(pos, end, device=q.device)[:, None]
            kpos = torch.arange(end, device=q.device)[None, :]
            mask = kpos <= qpos  # (T, L) bool
            if self.n_rep > 1:
                keys = _repeat_kv(keys, self.n_rep)
                values = _repeat_kv(values, self.n_rep)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2).reshape(1, T, H * hd)  # (1, T, H*hd)


# devices whose SDPA takes enable_gqa (others get keys/values repeated per query head)
_NATIVE_GQA = ("cpu", "cuda")


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, kvh, n, hd = x.shape
    return x[:, :, None].expand(b, kvh, n_rep, n, hd).reshape(b, kvh * n_rep, n, hd)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; parameter names match HF's ``model.layers.{i}.*``."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (1, T, D)
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Any,
        pos: int,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, self.layer_idx, pos)
        return h + self.mlp(self.post_attention_layernorm(h))  # (1, T, D)

    def forward_rows(self, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        """x (1, R, D): consecutive row spans, each a chunk at its own position of its own cache
        (several sessions' chunks, or several chunks of one session in order) -> (1, R, D).

        One span is :meth:`forward`. Several are one pass for everything that works row by row
        (the norms, the Q/K/V and output projections, the MLP: one weight read for all R rows)
        and attention span by span in order, each as :meth:`forward` of that chunk computes it
        (``Attention.attend``): a span writes its keys and values before the next one attends, so
        a chunk of one session that starts inside the one before overwrites those entries. Rows
        equal their one-span bits only where the row-wise kernels do not depend on the row count
        (rows.py proves it for a replay; batched.py accepts last-bit differences)."""
        if len(spans) == 1:
            s = spans[0]
            s.cache.at(s.pos, s.cos.shape[0])
            return self(x, s.cos, s.sin, s.cache, s.pos)  # type: ignore[no-any-return]
        attn = self.self_attn
        hn = self.input_layernorm(x)
        q, k, v = attn.q_proj(hn), attn.k_proj(hn), attn.v_proj(hn)  # (1, R, H*hd), (1, R, KV*hd) x2
        outs, off = [], 0
        for s in spans:
            T = s.cos.shape[0]
            sl = slice(off, off + T)
            s.cache.at(s.pos, T)
            outs.append(attn.attend(q[:, sl], k[:, sl], v[:, sl], s.cos, s.sin, s.cache, self.layer_idx, s.pos))
            off += T
        h = x + attn.o_proj(torch.cat(outs, dim=1))  # (1, R, D)
        return h + self.mlp(self.post_attention_layernorm(h))  # (1, R, D)


class Span(NamedTuple):
    """One chunk's rows in a :meth:`DecoderLayer.forward_rows` pass: where they go and their rotary."""

    cache: Any  # the chunk's session's KVCache
    pos: int  # the chunk's first position
    cos: torch.Tensor  # (T, hd): the chunk's rotary rows, T its row count
    sin: torch.Tensor  # (T, hd)
