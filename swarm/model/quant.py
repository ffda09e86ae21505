"""Weight-only quantization of a decoder block's linear layers, kept compact in memory.

Theory of operation
-------------------
``quantize_block(module, "int8" | "int4")`` walks ``module`` and replaces every ``nn.Linear`` with
a :class:`QuantLinear` that holds the weight in 8 or 4 bits and multiplies with torch's own packed
weight-only kernels. It knows nothing about the layer's structure, so it works on the hand-written
layers of ``layers.py`` and on transformers' decoder layers alike; a runtime calls it once per
layer, right after that layer's weights are loaded, so a stage never holds more than one layer in
the serving dtype beyond its compact size. Norms, biases, embeddings and the LM head stay in the
serving dtype.

Formats (``w`` is the weight (N, K): N output channels, K inputs; activations keep the serving dtype):

- ``int8``: per output channel, symmetric: ``w ≈ q · s[n]``, ``q`` in [-127, 127];
  kernel ``torch._weight_int8pack_mm`` (CPU; CUDA where torch has it).
- ``int4``: per group of ``group_size`` inputs, asymmetric: ``w ≈ (q - 8) · scale + zero``, ``q`` in
  [0, 15] (torch's tinygemm convention, which Q4_0, Q4_1 and Q4_K blocks map onto exactly).
  CPU: ``torch._convert_weight_to_int4pack_for_cpu`` + ``torch._weight_int4pack_mm_for_cpu``;
  CUDA: ``torch._convert_weight_to_int4pack`` + ``torch._weight_int4pack_mm``.

The packed kernels are used with bf16 activations only: with fp32 activations torch 2.13's CPU
kernels take a scalar path, measured here 40-120x slower than a dense fp32 matmul (10 ms against
0.22 ms for one token through a 1536x576 weight; 180 ms for 20 tokens), which made a ring's chunks
time out. fp32 therefore takes the ``dequant`` path below.

Scales (and zeros) are rounded to the serving dtype *before* the integers are chosen, so the
integers are the best ones for the scales the kernel actually uses; in fp32 every weight is within
half a step (``s/2``, ``scale/2``) of the original. Where no packed kernel applies (another
device such as MPS, an int4 shape the kernel refuses: N not a multiple of 16, or activations
that are not bf16) the layer keeps the same compact integers and
dequantizes its weight on each call (``kernel == "dequant"``): same memory, slower, same numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import ConfigError
from swarm.model.config import ModelArgs

QUANTS = ("none", "int8", "int4")
# int4 group size, chosen by benchmarks/bench_quant.py on the bundled model: 32 keeps perplexity
# at 1.000x the unquantized model's (its weights came from Q4_1 blocks of 32, which a group of 32
# reproduces) where 64 and 128 cost 1.45x; the price is 0.31 of bf16's bytes instead of 0.28,
# because torch's int4 kernels read a bf16 scale and zero per group (0.125 byte per weight at 32).
INT4_GROUP = 32
_INT4_GROUPS = (256, 128, 64, 32)


def check_quant(name: object, where: str = "quant") -> str:
    """``name`` if it is a quantization this program serves, else a ConfigError naming the choices."""
    if not isinstance(name, str) or name not in QUANTS:
        raise ConfigError(f"{where}: unknown quantization {name!r}; choose one of {', '.join(QUANTS)}")
    return name


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


def int8_from_float(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of w (N, K) -> (q int8 (N, K), s float32 (N,)), s in ``dtype``."""
    wf = w.float()
    s = wf.abs().amax(1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s)).to(dtype).float()
    q = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


@functools.cache
def _cuda_int8_kernel() -> bool:
    """Whether this torch build has a CUDA ``_weight_int8pack_mm`` (probed once on a tiny matrix)."""
    try:
        x = torch.zeros(1, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(16, 32, device="cuda", dtype=torch.int8)
        torch._weight_int8pack_mm(x, w, torch.ones(16, device="cuda", dtype=torch.bfloat16))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear`` (int8 per channel or int4 per group); see the module doc.

    The compact weight lives in buffers (so ``parameters()`` of a quantized block still yields the
    serving dtype of its norms); ``nbytes`` counts them.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, kind: str, in_features: int, out_features: int, dtype: torch.dtype,
                 kernel: str, group: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.dtype, self.kernel, self.group = dtype, kernel, group
        self.register_buffer("bias", None)

    # -------------------------------------------------------------------------- building
    @classmethod
    def int8(cls, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        n, k = w.shape
        q, s = int8_from_float(w, dtype)
        ok = dtype == torch.bfloat16 and (device.type == "cpu" or (device.type == "cuda" and _cuda_int8_kernel()))
        m = cls("int8", k, n, dtype, "int8pack" if ok else "dequant")
        m.register_buffer("qweight", q.to(device))  # (N, K) int8
        m.register_buffer("scales", s.to(device=device, dtype=dtype))  # (N,)
        m._set_bias(bias, device)
        return m

    @classmethod
    def int4(cls, g: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        n, k = g.q.shape
        if device.type == "cpu" and dtype == torch.bfloat16 and n % 16 == 0:
            kernel = "int4pack_cpu"
        elif device.type == "cuda" and dtype == torch.bfloat16 and n % 8 == 0 and k % 64 == 0:
            kernel = "int4pack_cuda"
        else:
            kernel = "dequant"
        m = cls("int4", k, n, dtype, kernel, g.group)
        # (K/gs, N, 2): the layout both torch int4 kernels read
        sz = torch.stack([g.scale, g.zero], -1).transpose(0, 1).contiguous().to(device=device, dtype=dtype)
        if kernel == "int4pack_cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), 2)  # (N, K/2) uint8
        elif kernel == "int4pack_cuda":
            pairs = g.q.to(device).view(n, k // 2, 2)
            inner = 8 if k % 256 == 0 else (4 if k % 128 == 0 else 2)
            packed = torch._convert_weight_to_int4pack((pairs[..., 0] << 4 | pairs[..., 1]).contiguous(), inner)
        else:  # (N, K/2): column j holds inputs j (low nibble) and j + K/2 (high nibble)
            packed = (g.q[:, : k // 2] | (g.q[:, k // 2 :] << 4)).contiguous()
        m.register_buffer("qweight", packed.to(device))
        m.register_buffer("scales_and_zeros", sz)
        m._set_bias(bias, device)
        return m

    def _set_bias(self, bias: torch.Tensor | None, device: torch.device) -> None:
        if bias is not None:
            self.register_buffer("bias", bias.detach().to(device=device, dtype=self.dtype))

    # -------------------------------------------------------------------------- compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (T, K)
        if self.kernel == "int8pack":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.kernel == "int4pack_cpu":
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros)
        elif self.kernel == "int4pack_cuda":
            y = torch._weight_int4pack_mm(x2, self.qweight, self.group, self.scales_and_zeros)
        elif self.kind == "int8":
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scales
        else:
            y = F.linear(x2, self.dequantized().to(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)  # (..., N)

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) the kernel multiplies by, in float32 (for tests and the fallback path)."""
        if self.kind == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        n, k = self.out_features, self.in_features
        sz = self.scales_and_zeros.float()  # (G, N, 2)
        if self.kernel == "dequant":
            q = torch.cat([self.qweight & 0xF, self.qweight >> 4], dim=1)  # (N, K)
            g = (q.view(n, k // self.group, self.group).float() - 8.0)
            return (g * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]).view(n, k)
        if self.kernel == "int4pack_cpu":
            q = self.qweight.new_empty(n * k)
            src = _cpu_int4_layout(n, k)  # (2, N*K/2): where each packed nibble came from
            q[src[0]] = self.qweight.reshape(-1) & 0xF
            q[src[1]] = self.qweight.reshape(-1) >> 4
            g = (q.view(n, k // self.group, self.group).float() - 8.0)
            return (g * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]).view(n, k)
        # CUDA's tiled layout: multiply the identity through the kernel
        eye = torch.eye(k, device=self.qweight.device, dtype=self.dtype)
        wt = torch._weight_int4pack_mm(eye, self.qweight, self.group, self.scales_and_zeros)
        return wt.float().T.contiguous()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        g = f", group={self.group}" if self.kind == "int4" else ""
        return f"{self.kind}, in={self.in_features}, out={self.out_features}{g}, kernel={self.kernel}"


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


def linear_paths(module: nn.Module) -> list[str]:
    """Dotted names of the ``nn.Linear`` modules inside ``module`` (what quantize_block replaces)."""
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def quantize_block(
    module: nn.Module,
    quant: str,
    *,
    dtype: torch.dtype | None = None,
    group: int = INT4_GROUP,
    given: Mapping[str, Int4Groups] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``module`` (in place) by a QuantLinear; returns ``module``.

    ``given`` maps a linear's dotted name to int4 groups read straight from a checkpoint (GGUF
    Q4_*): that layer's own weight is then ignored (it may be on the meta device). ``dtype`` is
    the serving dtype (default: each linear's weight dtype). ``quant == "none"`` changes nothing.
    """
    check_quant(quant)
    if quant == "none":
        return module
    given = dict(given or {})
    for path in linear_paths(module):
        lin = module.get_submodule(path)
        assert isinstance(lin, nn.Linear)
        dt = dtype or lin.weight.dtype
        dev = lin.weight.device if lin.weight.device.type != "meta" else _device_of(lin, given.get(path))
        bias = lin.bias
        if path in given:
            if quant != "int4":
                raise ConfigError(f"{path}: int4 groups given for a {quant} block")
            new = QuantLinear.int4(given.pop(path), bias, dt, dev)
        elif lin.weight.device.type == "meta":
            raise ConfigError(f"{path}: weight not loaded (on the meta device) and no compact form given")
        elif quant == "int8":
            new = QuantLinear.int8(lin.weight.detach(), bias, dt, dev)
        else:
            w = lin.weight.detach()
            new = QuantLinear.int4(int4_from_float(w, int4_group_for(w.shape[1], group), dt), bias, dt, dev)
        module.set_submodule(path, new)
        del lin
    if given:
        raise ConfigError(f"int4 groups given for layers that are not nn.Linear here: {sorted(given)}")
    return module


def _device_of(lin: nn.Linear, g: Int4Groups | None) -> torch.device:
    if lin.bias is not None and lin.bias.device.type != "meta":
        return lin.bias.device
    return g.q.device if g is not None else torch.device("cpu")


def block_nbytes(module: nn.Module) -> int:
    """Resident bytes of a block's weights: parameters plus buffers (compact weights included)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# ------------------------------------------------------------------------------ planning
def layer_bytes(args: ModelArgs, quant: str, dtype_bytes: int) -> int:
    """Resident bytes of one decoder layer's weights under ``quant`` (the planner's budget).

    Every 2-D weight of the layer is a linear that quantize_block replaces; the rest (norms,
    biases) stays in the serving dtype.
    """
    total = args.layer_bytes(dtype_bytes)
    for n, k in args.linear_shapes():  # the nn.Linear modules of the largest layer
        total += linear_bytes(n, k, quant, dtype_bytes) - n * k * dtype_bytes
    return total


def linear_bytes(n: int, k: int, quant: str, dtype_bytes: int, group: int = INT4_GROUP) -> int:
    """Bytes one (N, K) linear weight costs resident under ``quant`` (bias not included)."""
    check_quant(quant)
    if quant == "none":
        return n * k * dtype_bytes
    if quant == "int8":
        return n * k + n * dtype_bytes
    g = int4_group_for(k, group)
    return n * k // 2 + 2 * n * (k // g) * dtype_bytes
