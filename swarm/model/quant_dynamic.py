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


class DynamicInt8:
    """A weight (N, K) as per-channel int8 in fbgemm's packed layout; :meth:`matmul` quantizes the
    activation per call. CPU only (the packed object is not a tensor: it does not move)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, *, reduce_range: bool) -> None:
        n, k = q.shape
        with warnings.catch_warnings():  # the qint8 dtype's deprecation (see the module docstring)
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                q.cpu(), scales.cpu().double(), torch.zeros(n, dtype=torch.long), 0
            )
            with _fbgemm_engine():
                self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.n, self.k, self.reduce_range = n, k, reduce_range

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype, *, reduce_range: bool) -> DynamicInt8:
        """The int8 weight quant_formats.Packed.int8 would hold (scales rounded to ``dtype``), packed."""
        q, s = int8_from_float(w, dtype)
        return cls(q, s, reduce_range=reduce_range)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) in any float dtype -> x @ w.T (T, N) float32, x quantized once over its T rows."""
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)  # type: ignore[no-any-return]

    def weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 (N, K), scales float32 (N,)): the integers and scales the kernel multiplies by."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            qw, _ = torch.ops.quantized.linear_unpack(self.packed)
            return qw.int_repr(), qw.q_per_channel_scales().float()

    def nbytes(self) -> int:
        """Bytes held in the packed layout (the int8 weight; fbgemm's column offsets are ~N * 4 more)."""
        return self.n * self.k + 4 * self.n
