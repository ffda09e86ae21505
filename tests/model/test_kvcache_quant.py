"""The quantized KV cache formats (int8, fp8): bounded round-trip error, about half the bytes of
bf16, attention close to the unquantized cache's, rollback unchanged, and one format per stage.

Every bound here is the format's own arithmetic (half a step of int8 at absmax/127, half an ulp of
e4m3's 3 mantissa bits), computed in float32 with a margin for the bf16 scale: nothing depends on
how this CPU rounds a sum.
"""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ModelError
from swarm.model.capability import Capability, cpu, cuda, kv_format_problem, mps
from swarm.model.config import ModelArgs
from swarm.model.kvcache import (
    KV_FORMATS,
    KVCache,
    dequantize,
    kv_bytes_per_token_per_layer,
    quantize,
)
from swarm.testing.checkpoints import TinySpec, tiny_config


def rand(t: int, heads: int = 3, hd: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, t, hd, generator=g) * torch.rand(1, heads, t, 1, generator=g) * 10  # per-vector ranges
    return x.to(dtype)


def write(c: KVCache, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    c.begin(k.shape[2])
    out = c.update(k, v, layer)
    c.advance(k.shape[2])
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_round_trip_error_is_within_the_formats_step(fmt: str) -> None:
    x = rand(40)
    x[0, 1, 3] = 0.0  # an all-zero vector: scale clamped, read back as zeros (no NaN)
    codes, scales = quantize(x, fmt)
    assert codes.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn) and scales.shape == (1, 3, 40, 1)
    back = dequantize(codes, scales, torch.float32)
    err = (back - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)
    if fmt == "int8":
        bound = absmax / 127 * 0.5 * (1 + 2**-7) + 1e-6  # half a step; the bf16 scale is within 2^-8 of absmax/127
    else:
        bound = x.abs() * 2**-4 * (1 + 2**-7) + absmax / 448 * 2**-9 + 1e-6  # half an ulp (3 bits), subnormals
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[0, 1, 3], torch.zeros(64)) and bool(back.isfinite().all())
    # the largest value of every vector survives within its step: the scale never overflows the format
    assert bool(((back.abs().amax(-1, keepdim=True) - absmax).abs() <= absmax * 2**-6 + 1e-6).all())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_cache_is_about_half_a_bf16_one(fmt: str) -> None:
    k = rand(16, dtype=torch.bfloat16)
    full, small = KVCache(64, dtype=torch.bfloat16, device="cpu"), KVCache(64, dtype=torch.bfloat16, device="cpu", kv_cache=fmt)
    for layer in range(3):
        write(full, k, k, layer)
        write(small, k, k, layer)
        full.rollback(0), small.rollback(0)
    ratio = small.nbytes() / full.nbytes()
    assert ratio == pytest.approx((64 + 2) / 128)  # head_dim 64: one byte a value plus a 2-byte scale per vector
    # the planner's arithmetic says the same, per token per layer
    args = ModelArgs.from_config(tiny_config(TinySpec(family="llama")))
    per = kv_bytes_per_token_per_layer(args, fmt, 2)
    assert per == 2 * args.n_kv_heads * (args.head_dim + 2)
    assert kv_bytes_per_token_per_layer(args, "auto", 2) == args.kv_bytes_per_token_per_layer(2)


@pytest.mark.parametrize(("fmt", "tol"), [("int8", 0.02), ("fp8", 0.08)])
def test_attention_over_a_quantized_cache_is_close_to_the_unquantized(fmt: str, tol: float) -> None:
    """Random queries over a prefill and then decode steps; the relative error of the attention
    output (Frobenius norm) stays within a few per cent: int8's step is 1/254 of a vector's
    range, e4m3's 1/16 of a value."""
    full = KVCache(96, dtype=torch.float32, device="cpu")
    small = KVCache(96, dtype=torch.float32, device="cpu", kv_cache=fmt)
    g = torch.Generator().manual_seed(7)
    errs = []
    for step, t in enumerate([64, 1, 1, 1, 8]):
        k, v = rand(t, seed=10 + step), rand(t, seed=20 + step)
        q = torch.randn(1, 3, t, 64, generator=g)
        kf, vf = write(full, k, v)
        kq, vq = write(small, k, v)
        assert kq.dtype == torch.float32 and kq.shape == kf.shape
        causal = full.length == t
        ref = torch.nn.functional.scaled_dot_product_attention(q, kf, vf, is_causal=causal)
        got = torch.nn.functional.scaled_dot_product_attention(q, kq, vq, is_causal=causal)
        errs.append(float((got - ref).norm() / ref.norm()))
    assert max(errs) < tol, errs
    assert min(errs) > 0  # it did quantize


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_rollback_then_rewrite_gives_what_a_fresh_cache_gives(fmt: str) -> None:
    """A speculative chunk's rejected tail: roll back, write other tokens; the result is what a
    cache that never saw the rejected ones holds (scales are overwritten with their entries)."""
    a, b = KVCache(32, dtype=torch.bfloat16, device="cpu", kv_cache=fmt), KVCache(32, dtype=torch.bfloat16, device="cpu", kv_cache=fmt)
    base, rejected, accepted = rand(10, seed=1, dtype=torch.bfloat16), rand(5, seed=2, dtype=torch.bfloat16) * 50, rand(3, seed=3, dtype=torch.bfloat16)
    write(a, base, base)
    write(a, rejected, rejected)
    before = a.nbytes()
    a.rollback(12)  # keep two of the five
    assert a.length == 12 and a.nbytes() == before  # O(1): nothing freed or copied
    a.rollback(10)
    ka, va = write(a, accepted, accepted)
    write(b, base, base)
    kb, vb = write(b, accepted, accepted)
    assert a.length == b.length == 13 and torch.equal(ka, kb) and torch.equal(va, vb)
    with pytest.raises(ModelError, match="roll back"):
        a.rollback(14)


def test_a_vectors_bytes_do_not_depend_on_its_chunk() -> None:
    """One chunk of 6 or 6 chunks of one: the same cache (a replay, a ring and one process agree)."""
    x = rand(6, seed=4, dtype=torch.bfloat16)
    whole, steps = KVCache(8, dtype=torch.bfloat16, device="cpu", kv_cache="int8"), KVCache(8, dtype=torch.bfloat16, device="cpu", kv_cache="int8")
    kw, _ = write(whole, x, x)
    for i in range(6):
        ks, _ = write(steps, x[:, :, i : i + 1], x[:, :, i : i + 1])
    assert torch.equal(kw, ks)


def test_an_unknown_format_is_refused_naming_the_choices() -> None:
    with pytest.raises(ModelError, match="choose one of auto, int8, fp8"):
        KVCache(8, dtype=torch.float32, device="cpu", kv_cache="int4")


@pytest.mark.parametrize(
    ("cap", "ok"),
    [(cpu(False), True), (cuda(9, 0), True), (cuda(8, 9), True), (cuda(8, 6), False), (cuda(7, 5), False),
     (mps(), False), (Capability("meta", True), True)],
)
def test_fp8_only_where_the_device_has_it(cap: Capability, ok: bool) -> None:
    assert (kv_format_problem(cap, "fp8") is None) == ok
    assert kv_format_problem(cap, "int8") is None and kv_format_problem(cap, "auto") is None
    if not ok:
        assert "use int8" in str(kv_format_problem(cap, "fp8"))

