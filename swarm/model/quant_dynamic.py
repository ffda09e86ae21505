"""An int8 weight times an activation quantized on each call: fbgemm's dynamic int8 linear.

Theory of operation
-------------------
torch's weight-only ``_weight_int8pack_mm`` (quant_formats.Packed, kernel ``int8pack``) converts
each int8 weight to a float and multiplies in floating point. fbgemm's dynamic linear instead
quantizes the activation rows to uint8 on each call (one scale and zero point over the rows given:
``x ≈ (xq - zp) · sx``, each element within ``sx / 2``) and multiplies integers (AVX512-VNNI /
AVX2 dot products), as llama.cpp does with its Q8 activations. The weight is the same per-channel
symmetric int8 (quant_formats.int8_from_float: same integers, same scales), repacked into fbgemm's
layout once (the original integers are not kept: the packed copy costs about the same bytes).

Measured on this project's 2-core AVX512-VNNI EPYC, 1 thread, one token, the 262144x640 LM head of
Gemma-3-270M (benchmarks/bench_head_matmul.py, load 4.2): int8pack 28.0 ms, fbgemm 12.1 ms. Tried
beside them in a scratch script (alternated, medians): onednn's ``qlinear_pointwise`` (the op
without quantized tensors that inductor uses, uint8 activations; int8 ones take a reference path,
4 s) 15.9 ms where fbgemm took 11.8 and int8pack 27.8 (load 2.7); ``torch._int_mm`` 19.0 ms where
fbgemm took 9.6 and int8pack 25.0 (load 0.7); int8pack over row blocks of 16384 no faster (25.1).

Saturation: without VNNI, fbgemm adds pairs of uint8 x int8 products in int16 (``vpmaddubsw``),
which saturates past 32767 (2 x 255 x 127 = 64770); ``reduce_range`` quantizes the activation to 7
bits (0..127) so that a pair never does (2 x 127 x 127 = 32258). It costs half the activation's
resolution, so it is used only where the CPU lacks VNNI (capability.Capability.vnni).

The front door is deprecated: fbgemm takes the weight as a ``torch.qint8`` tensor, a dtype torch
2.13 warns "will be removed in a future PyTorch release" (pytorch/pytorch#184982). The kernel is
only chosen where :func:`fbgemm_available` finds it, so a torch without it falls back to int8pack.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch

from swarm.model.quant_formats import int8_from_float


@functools.cache
def fbgemm_available() -> bool:
    """Whether this torch runs fbgemm's dynamic int8 linear on this CPU (x86-64 builds; the
    quantized engine is listed only where the CPU has the instructions fbgemm needs)."""
    ops = torch.ops.quantized
    return "fbgemm" in torch.backends.quantized.supported_engines and all(
        hasattr(ops, name) for name in ("linear_prepack", "linear_dynamic", "linear_unpack")
    )


@contextlib.contextmanager
def _fbgemm_engine() -> Iterator[None]:
    """fbgemm as the quantized engine while packing (the packed object remembers it), then back."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


# rows packed at a time: fbgemm's prepack copies what it is given twice (a quantized tensor, then its
# own layout), so packing a whole head at once held ~3.6x its int8 bytes above the dense head (the
# bundled model's 27 MB head: +97 MB at its peak); a block of rows at a time holds one block's copies
# besides the packed blocks (the output rows of a block depend on that block alone, and the
# activation is quantized the same way at every call, so the product is the same)
BLOCK_ROWS = 16384


class DynamicInt8:
    """A weight (N, K) as per-channel int8 in fbgemm's packed layout, in blocks of BLOCK_ROWS rows;
    :meth:`matmul` quantizes the activation per call. CPU only (the packed objects are not tensors:
    they do not move)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, *, reduce_range: bool) -> None:
        rows = range(0, q.shape[0], BLOCK_ROWS)
        self._hold([_pack(q[r : r + BLOCK_ROWS], scales[r : r + BLOCK_ROWS]) for r in rows], q.shape, reduce_range)

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype, *, reduce_range: bool) -> DynamicInt8:
        """The int8 weight quant_formats.Packed.int8 would hold (scales rounded to ``dtype``), packed
        a block of rows at a time (no int8 copy of the whole weight is ever held beside the packed one)."""
        lin = cls.__new__(cls)
        rows = range(0, w.shape[0], BLOCK_ROWS)
        lin._hold([_pack(*int8_from_float(w[r : r + BLOCK_ROWS], dtype)) for r in rows], w.shape, reduce_range)
        return lin

    def _hold(self, packed: list[object], shape: torch.Size, reduce_range: bool) -> None:
        self.packed = packed
        self.n, self.k = shape
        self.reduce_range = reduce_range

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) in any float dtype -> x @ w.T (T, N) float32, x quantized once over its T rows."""
        xf = x.float()
        outs = [torch.ops.quantized.linear_dynamic(xf, p, self.reduce_range) for p in self.packed]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 (N, K), scales float32 (N,)): the integers and scales the kernel multiplies by."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            qws = [torch.ops.quantized.linear_unpack(p)[0] for p in self.packed]
            return torch.cat([qw.int_repr() for qw in qws]), torch.cat([qw.q_per_channel_scales().float() for qw in qws])

    def nbytes(self) -> int:
        """Bytes held in the packed layout (the int8 weight; fbgemm's column offsets are ~N * 4 more)."""
        return self.n * self.k + 4 * self.n


def _pack(q: torch.Tensor, scales: torch.Tensor) -> object:
    """fbgemm's packed form of int8 rows ``q`` (n, K) with their scales (n,)."""
    n = q.shape[0]
    with warnings.catch_warnings():  # the qint8 dtype's deprecation (see the module docstring)
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q.cpu(), scales.cpu().double(), torch.zeros(n, dtype=torch.long), 0)
        with _fbgemm_engine():
            return torch.ops.quantized.linear_prepack(qw, None)
