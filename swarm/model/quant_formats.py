"""int8/int4 weights in torch's packed layouts: choosing the integers, packing, multiplying.

Theory of operation
-------------------
Formats (``w`` is a weight (N, K): N output channels, K inputs; activations keep the serving dtype):

- ``int8``: per output channel, symmetric: ``w ≈ q · s[n]``, ``q`` in [-127, 127];
  kernel ``torch._weight_int8pack_mm`` (CPU and MPS; on CUDA int8 times scales through cuBLAS).
- ``int4``: per group of ``group`` inputs, asymmetric: ``w ≈ (q - 8) · scale + zero``, ``q`` in
  [0, 15] (torch's tinygemm convention, which Q4_0, Q4_1 and Q4_K blocks map onto exactly).
  CPU: ``torch._convert_weight_to_int4pack_for_cpu`` + ``torch._weight_int4pack_mm_for_cpu``;
  CUDA (sm80+) and MPS: ``torch._convert_weight_to_int4pack`` + ``torch._weight_int4pack_mm``.
  Which kernel a device may use is capability.py's table (its docstring has the reasons).

- ``mxfp4`` (OCP Microscaling, gpt-oss's experts as released): per 32 inputs a power-of-two scale
  (a uint8 exponent + 127) and 32 FP4 (E2M1) codes, two per byte: 4.25 bits per weight. No torch
  kernel multiplies by it, so an expert's weight is decoded to the serving dtype when a token is
  routed to it (``dequant``), and only then: the experts stay MXFP4 at rest. Every MXFP4 value
  is exact in bf16, fp16 and fp32, and :func:`mxfp4_from_float` re-encodes a decoded MXFP4 weight
  to the same values (it picks the smallest exponent that fits each block's largest value).

A :class:`Packed` says how one weight is laid out and which kernel multiplies by it; the module
that owns the weight holds its integer and scale tensors as buffers. A linear layer holds one
weight (quant.QuantLinear); a MoE layer's experts hold one per expert, stacked along a leading
expert axis (quant_experts.QuantExperts), and multiply by ``qweight[e]``: every expert of a
projection has the same shape, hence the same kernel and layout.

The packed kernels are used with bf16 activations only: with fp32 activations torch 2.13's CPU
kernels take a scalar path, measured here 40-120x slower than a dense fp32 matmul (10 ms against
0.22 ms for one token through a 1536x576 weight; 180 ms for 20 tokens), which made a ring's chunks
time out. fp32 therefore takes the ``dequant`` path.

Scales (and zeros) are rounded to the serving dtype *before* the integers are chosen, so the
integers are the best ones for the scales the kernel actually uses; in fp32 every weight is within
half a step (``s/2``, ``scale/2``) of the original. Where no packed kernel applies (a device or
dtype the table refuses, an int4 shape the kernel refuses: N not a multiple of 16) the weight keeps the same compact integers and is dequantized on each call
(``kernel == "dequant"``): same memory, slower, same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.errors import ConfigError
from swarm.model.capability import choose_kernel

# int4 group size, chosen by benchmarks/bench_quant.py on the bundled model: 32 keeps perplexity
# at 1.000x the unquantized model's (its weights came from Q4_1 blocks of 32, which a group of 32
# reproduces) where 64 and 128 cost 1.45x; the price is 0.3125 of bf16's bytes instead of 0.28,
# because torch's int4 kernels read a bf16 scale and zero per group (0.125 byte per weight at 32).
# Larger groups for some kinds of matrix only (results: int4_group_by_matrix) reach <= 0.30 only
# with the MLP's, which cost 2-15% perplexity on both offline models, so every matrix keeps 32.
INT4_GROUP = 32
_INT4_GROUPS = (256, 128, 64, 32)


@dataclass
class Int4Groups:
    """An int4 weight before packing: ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``, g = k // group."""

    q: torch.Tensor  # (N, K) uint8 in [0, 15]
    scale: torch.Tensor  # (N, K // group) float32
    zero: torch.Tensor  # (N, K // group) float32
    group: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = (self.q.view(n, k // self.group, self.group).float() - 8.0)
        return (g * self.scale[..., None] + self.zero[..., None]).view(n, k)  # (N, K) float32

    def rows(self, order: torch.Tensor) -> Int4Groups:
        """The same weight with its output channels reordered."""
        return Int4Groups(self.q[order], self.scale[order], self.zero[order], self.group)


def int4_group_for(k: int, group: int = INT4_GROUP) -> int:
    """``group`` if it divides K, else the largest smaller kernel group that does (ConfigError if none)."""
    for g in (group, *[g for g in _INT4_GROUPS if g < group]):
        if k % g == 0:
            return g
    raise ConfigError(f"int4: a linear layer with {k} inputs is not a multiple of any group size {_INT4_GROUPS}")


def int4_from_float(w: torch.Tensor, group: int, dtype: torch.dtype) -> Int4Groups:
    """Group-wise asymmetric min/max int4 of w (N, K); scale and zero rounded to ``dtype`` first."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)  # (N, G, gs)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(dtype).float()
    zero = (lo + 8.0 * scale).to(dtype).float()
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.view(n, k), scale, zero, group)


# the 16 values an E2M1 code stands for (code 8 is -0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the magnitudes 0 .. 6
_MXFP4_ROWS = 256  # rows encoded at a time: temporaries of ~20 bytes a weight stay small


def mxfp4_from_float(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) -> (codes (..., N, K/2) uint8, even input in the low nibble; scales
    (..., N, K/32) uint8, exponent + 127). K must be a multiple of 32 (ConfigError otherwise).
    Each value takes the nearest code (a tie: the smaller magnitude), rows a few at a time."""
    *lead, n, k = w.shape
    if k % 32:
        raise ConfigError(f"mxfp4: a weight with {k} inputs is not a multiple of its block of 32")
    flat = w.reshape(-1, k)  # (R, K)
    codes = torch.empty(flat.shape[0], k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(flat.shape[0], k // 32, dtype=torch.uint8, device=w.device)
    mid = torch.tensor(_FP4_MIDPOINTS, device=w.device)
    for r in range(0, flat.shape[0], _MXFP4_ROWS):
        g = flat[r : r + _MXFP4_ROWS].float().reshape(-1, k // 32, 32)  # (rows, K/32, 32)
        amax = g.abs().amax(-1).clamp_min(2.0**-126)
        exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # 6 = 1.5 * 2^2: the largest code
        scaled = g / torch.exp2(exp)[..., None]
        mag = torch.bucketize(scaled.abs().contiguous(), mid).to(torch.uint8)  # 0..7: index into 0, 0.5, .. 6
        c = mag | ((scaled < 0) & (mag > 0)).to(torch.uint8) << 3  # the sign bit (no -0)
        c = c.reshape(c.shape[0], k)
        codes[r : r + _MXFP4_ROWS] = c[:, 0::2] | (c[:, 1::2] << 4)
        scales[r : r + _MXFP4_ROWS] = (exp + 127).to(torch.uint8)
    return codes.reshape(*lead, n, k // 2), scales.reshape(*lead, n, k // 32)


def mxfp4_to_float(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight (..., N, K) in ``dtype`` that MXFP4 ``codes`` (..., N, K/2) and ``scales`` stand for."""
    *lead, n, half = codes.shape
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=codes.device)
    idx = torch.stack([codes & 0xF, codes >> 4], -1).reshape(*lead, n, half * 2 // 32, 32).long()
    scale = torch.exp2(scales.to(torch.int32).sub(127).to(torch.float32)).to(dtype)  # exact powers of two
    return (table[idx] * scale[..., None]).reshape(*lead, n, half * 2)


INT8_ROWS = 4096  # rows quantized at a time: a 262144-row LM head's float32 temporaries stay small


def int8_from_float(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of w (N, K) -> (q int8 (N, K), s float32 (N,)), s in ``dtype``
    (a few thousand rows at a time: each row's integers depend on that row alone)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], INT8_ROWS):
        wf = w[r : r + INT8_ROWS].float()
        sr = wf.abs().amax(1) / 127.0
        sr = torch.where(sr > 0, sr, torch.ones_like(sr)).to(dtype).float()
        q[r : r + INT8_ROWS] = torch.round(wf / sr[:, None]).clamp(-127, 127).to(torch.int8)
        s[r : r + INT8_ROWS] = sr
    return q, s


@dataclass(frozen=True)
class Packed:
    """How one compact weight (N, K) is laid out and multiplied; its tensors are held by the module
    that owns it (as buffers, so they move with ``.to()``) and passed in on every call.

    ``qweight``: int8 (N, K) for int8; for int4 the kernel's packed nibbles (CPU: (N, K/2) uint8 in
    torch's private tiling; CUDA: its tiled 4-D layout; dequant: (N, K/2), column j holding inputs j
    (low nibble) and j + K/2 (high nibble)). ``scales``: int8 (N,); int4 (K/group, N, 2) scale and
    zero, the layout both torch int4 kernels read. Both in the serving dtype ``dtype``.
    """

    kind: str  # "int8" | "int4" | "mxfp4"
    kernel: str  # "int8pack" | "int4pack_cpu" | "int4pack_cuda" | "dequant"
    n: int
    k: int
    group: int  # int4 only (0 for int8)
    dtype: torch.dtype

    @classmethod
    def int8(
        cls, w: torch.Tensor, dtype: torch.dtype, device: torch.device, *, kernel: str | None = None
    ) -> tuple[Packed, torch.Tensor, torch.Tensor]:
        """(layout, qweight, scales) of a float weight (N, K), on ``device``; the kernel is the
        capability table's choice for that device (capability.py) unless ``kernel`` is given."""
        n, k = w.shape
        q, s = int8_from_float(w, dtype)
        kernel = kernel or choose_kernel("int8", device, dtype, n, k)
        return cls("int8", kernel, n, k, 0, dtype), q.to(device), s.to(device=device, dtype=dtype)

    @classmethod
    def int4(
        cls, g: Int4Groups, dtype: torch.dtype, device: torch.device, *, kernel: str | None = None
    ) -> tuple[Packed, torch.Tensor, torch.Tensor]:
        """(layout, qweight, scales_and_zeros) of int4 groups, on ``device`` (see :meth:`int8`)."""
        n, k = g.q.shape
        kernel = kernel or choose_kernel("int4", device, dtype, n, k)
        sz = torch.stack([g.scale, g.zero], -1).transpose(0, 1).contiguous().to(device=device, dtype=dtype)
        if kernel == "int4pack_cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(g.q.cpu().to(torch.int32), 2)  # (N, K/2) uint8
        elif kernel == "int4pack_cuda":
            pairs = g.q.to(device).view(n, k // 2, 2)
            inner = 8 if k % 256 == 0 else (4 if k % 128 == 0 else 2)
            packed = torch._convert_weight_to_int4pack((pairs[..., 0] << 4 | pairs[..., 1]).contiguous(), inner)
        else:
            packed = (g.q[:, : k // 2] | (g.q[:, k // 2 :] << 4)).contiguous()
        return cls("int4", kernel, n, k, g.group, dtype), packed.to(device), sz

    @classmethod
    def mxfp4(cls, w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> tuple[Packed, torch.Tensor, torch.Tensor]:
        """(layout, codes, scales) of a float weight (N, K), encoded where ``w`` is (the host)."""
        n, k = w.shape
        codes, scales = mxfp4_from_float(w)
        return cls("mxfp4", "dequant", n, k, 32, dtype), codes.to(device), scales.to(device)

    def matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x (T, K) -> x @ w.T (T, N)."""
        if self.kernel == "int8pack":
            return torch._weight_int8pack_mm(x, qweight, scales)
        if self.kernel == "int4pack_cpu":
            return torch._weight_int4pack_mm_for_cpu(x, qweight, self.group, scales)
        if self.kernel == "int4pack_cuda":
            return torch._weight_int4pack_mm(x, qweight, self.group, scales)
        if self.kind == "int8":
            return F.linear(x, qweight.to(x.dtype)) * scales
        if self.kind == "mxfp4":
            return F.linear(x, mxfp4_to_float(qweight, scales, x.dtype))
        return F.linear(x, self.dequantized(qweight, scales).to(x.dtype))

    def dequantized(self, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The weight (N, K) the kernel multiplies by, in float32 (for tests and the dequant path)."""
        n, k = self.n, self.k
        if self.kind == "int8":
            return qweight.float() * scales.float()[:, None]
        if self.kind == "mxfp4":
            return mxfp4_to_float(qweight, scales)
        if self.kernel == "int4pack_cuda":  # its tiled layout: multiply the identity through the kernel
            eye = torch.eye(k, device=qweight.device, dtype=self.dtype)
            return torch._weight_int4pack_mm(eye, qweight, self.group, scales).float().T.contiguous()
        if self.kernel == "dequant":
            q = torch.cat([qweight & 0xF, qweight >> 4], dim=1)  # (N, K)
        else:
            q = qweight.new_empty(n * k)
            src = _cpu_int4_layout(n, k)  # (2, N*K/2): where each packed nibble came from
            q[src[0]] = qweight.reshape(-1) & 0xF
            q[src[1]] = qweight.reshape(-1) >> 4
        sz = scales.float()  # (G, N, 2)
        g = (q.view(n, k // self.group, self.group).float() - 8.0)
        return (g * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]).view(n, k)


@functools.lru_cache(maxsize=8)
def _cpu_int4_layout(n: int, k: int) -> torch.Tensor:
    """The CPU packer's nibble order, learnt from torch itself: pack the base-16 digits of each
    element's index and read them back (its tiling is private and differs per CPU kernel)."""
    idx = torch.arange(n * k, dtype=torch.int64).view(n, k)
    lo = torch.zeros(n * k // 2, dtype=torch.int64)
    hi = torch.zeros_like(lo)
    for j in range(max(1, ((n * k - 1).bit_length() + 3) // 4)):
        p = torch._convert_weight_to_int4pack_for_cpu(((idx >> (4 * j)) & 15).to(torch.int32), 2).reshape(-1)
        lo |= (p & 15).long() << (4 * j)
        hi |= (p >> 4).long() << (4 * j)
    return torch.stack([lo, hi])


def pack(
    w: torch.Tensor, kind: str, dtype: torch.dtype, device: torch.device, group: int = INT4_GROUP
) -> tuple[Packed, torch.Tensor, torch.Tensor]:
    """A float weight (N, K) quantized and packed as ``kind`` ("int8", "mxfp4", or "int4" at
    ``group`` or the largest smaller group that divides K): (layout, qweight, scales)."""
    if kind == "int8":
        return Packed.int8(w, dtype, device)
    if kind == "mxfp4":
        return Packed.mxfp4(w, dtype, device)
    return Packed.int4(int4_from_float(w, int4_group_for(w.shape[1], group), dtype), dtype, device)


def packed_nbytes(n: int, k: int, kind: str, dtype_bytes: int, group: int = INT4_GROUP) -> int:
    """Bytes one (N, K) weight costs resident as ``kind`` ("none", "int8", "int4")."""
    if kind == "none":
        return n * k * dtype_bytes
    if kind == "int8":
        return n * k + n * dtype_bytes
    if kind == "mxfp4":
        return n * k // 2 + n * k // 32
    g = int4_group_for(k, group)
    return n * k // 2 + 2 * n * (k // g) * dtype_bytes
