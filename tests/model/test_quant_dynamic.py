"""fbgemm's dynamic int8 linear (quant_dynamic.DynamicInt8): the integers it holds are
int8_from_float's, and its product is within the activation's rounding bound of the exact product
with those integers, for several rows quantized with one scale, an outlier among them, and the
7-bit activations a CPU without VNNI gets. The bound is computed from the inputs (never from the
error observed), so it holds on any x86-64: ``|x - x̂| <= sx / 2`` per element, ``sx`` the step
of x's range with zero included, 255 steps (127 with reduce_range)."""

from __future__ import annotations

import pytest
import torch

from swarm.model.dtypes import cpu_has_avx512_vnni
from swarm.model.quant_dynamic import DynamicInt8, fbgemm_available
from swarm.model.quant_formats import int8_from_float

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="torch runs no fbgemm on this CPU (not x86-64)")

N, K = 96, 160
# 8-bit activations only where they are used: fbgemm without AVX512-VNNI sums u8*s8 pairs in int16,
# which can saturate (so capability.dynamic_reduce_range gives such CPUs 7 bits, never 8)
_EIGHT_BITS = [pytest.param(False, marks=pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="8-bit activations "
                                                            "saturate in fbgemm without VNNI; this CPU is given 7")), True]  # fmt: skip


def _weight() -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(0))


def test_it_holds_the_integers_and_scales_of_int8_from_float() -> None:
    w = _weight()
    got_q, got_s = DynamicInt8.from_float(w, torch.bfloat16, reduce_range=False).weight()
    want_q, want_s = int8_from_float(w, torch.bfloat16)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_s, want_s)


@pytest.mark.parametrize("reduce_range", _EIGHT_BITS)
@pytest.mark.parametrize("outlier", [1.0, 40.0])
def test_its_product_is_within_the_activation_rounding_bound(reduce_range: bool, outlier: float) -> None:
    w = _weight()
    lin = DynamicInt8.from_float(w, torch.bfloat16, reduce_range=reduce_range)
    q, s = int8_from_float(w, torch.bfloat16)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    x[2, 7] *= outlier  # one row's element far out: every row's step grows (one scale per call)
    got = lin.matmul(x.to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (5, N)
    xb = x.to(torch.bfloat16).float()  # what the kernel was given
    exact = xb.double() @ (q.double() * s.double()[:, None]).T  # (5, N)
    sx = float(xb.max().clamp(min=0) - xb.min().clamp(max=0)) / (127 if reduce_range else 255)
    bound = sx / 2 * s.double() * q.double().abs().sum(1)  # (N,)
    err = (got.double() - exact).abs()
    assert torch.all(err <= bound * 1.001 + 1e-4), float((err / bound).max())
    assert float(err.max()) > 0  # the activation really was rounded


@pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="8-bit activations saturate in fbgemm without VNNI")
def test_seven_bit_activations_round_coarser_than_eight() -> None:
    w = _weight()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    q, s = int8_from_float(w, torch.float32)
    exact = x @ (q.float() * s[:, None]).T
    err8 = (DynamicInt8(q, s, reduce_range=False).matmul(x) - exact).abs().mean()
    err7 = (DynamicInt8(q, s, reduce_range=True).matmul(x) - exact).abs().mean()
    assert err7 > 1.3 * err8  # about twice: the flag reaches the kernel


def test_a_weight_packed_in_blocks_of_rows_multiplies_as_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head is packed BLOCK_ROWS rows at a time (packing's copies stay a block's): the blocks'
    products, side by side, are the one-block product bit for bit, and hold the same integers."""
    from swarm.model import quant_dynamic

    w = _weight()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = DynamicInt8.from_float(w, torch.bfloat16, reduce_range=True)
    monkeypatch.setattr(quant_dynamic, "BLOCK_ROWS", 40)  # 96 rows: blocks of 40, 40 and 16
    blocks = DynamicInt8.from_float(w, torch.bfloat16, reduce_range=True)
    q, s = int8_from_float(w, torch.bfloat16)
    also = DynamicInt8(q, s, reduce_range=True)
    assert len(whole.packed) == 1 and len(blocks.packed) == len(also.packed) == 3
    for lin in (blocks, also):
        assert torch.equal(lin.matmul(x), whole.matmul(x))
        assert all(torch.equal(a, b) for a, b in zip(lin.weight(), whole.weight(), strict=True))
