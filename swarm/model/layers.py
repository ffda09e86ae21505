"""Llama-family building blocks: RMSNorm, rotary embeddings (incl. llama3 scaling), GQA, SwiGLU.

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

import torch
import torch.nn.functional as F
from torch import nn

from swarm.model.config import ModelArgs


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
        k_cache: torch.Tensor,  # (KV, max_len, hd) of this layer, written in place
        v_cache: torch.Tensor,  # (KV, max_len, hd)
        pos: int,
    ) -> torch.Tensor:
        _, T, _ = x.shape
        q = self.q_proj(x).view(1, T, self.n_heads, self.head_dim).transpose(1, 2)  # (1, H, T, hd)
        k = self.k_proj(x).view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (1, KV, T, hd)
        v = self.v_proj(x).view(1, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (1, KV, T, hd)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        end = pos + T
        k_cache[:, pos:end] = k[0]
        v_cache[:, pos:end] = v[0]
        keys = k_cache[:, :end].unsqueeze(0)  # (1, KV, L, hd)
        values = v_cache[:, :end].unsqueeze(0)  # (1, KV, L, hd)

        if T == 1:
            # decode: pack the n_rep query heads that share a KV head as a length-n_rep "sequence"
            qp = q.reshape(1, self.n_kv_heads, self.n_rep, self.head_dim)  # (1, KV, n_rep, hd)
            out = F.scaled_dot_product_attention(qp, keys, values, scale=self.scale)
            out = out.reshape(1, self.n_heads, 1, self.head_dim)  # (1, H, 1, hd)
        elif pos == 0:
            # prefill from an empty cache: top-left causal alignment is correct
            if self.n_rep > 1 and x.device.type not in _NATIVE_GQA:
                keys = _repeat_kv(keys, self.n_rep)
                values = _repeat_kv(values, self.n_rep)
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale,
                enable_gqa=self.n_rep > 1 and x.device.type in _NATIVE_GQA,
            )  # (1, H, T, hd)
        else:
            # chunk after a cache: query i sits at pos+i and sees keys 0..pos+i
            qpos = torch.arange(pos, end, device=x.device)[:, None]
            kpos = torch.arange(end, device=x.device)[None, :]
            mask = kpos <= qpos  # (T, L) bool
            if self.n_rep > 1:
                keys = _repeat_kv(keys, self.n_rep)
                values = _repeat_kv(values, self.n_rep)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(1, T, self.n_heads * self.head_dim)  # (1, T, H*hd)
        return self.o_proj(out)  # (1, T, D)


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

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (1, T, D)
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, pos)
        return h + self.mlp(self.post_attention_layernorm(h))  # (1, T, D)
