"""KVCache: preallocated once, bounded, rolled back in O(1) without touching the tensors."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ModelError
from swarm.model.kvcache import KVCache


def make(max_len: int = 8) -> KVCache:
    return KVCache(2, 3, max_len, 4, dtype=torch.float32, device="cpu")


def test_preallocated_shape_and_dtype() -> None:
    c = make()
    assert c.k.shape == c.v.shape == (2, 3, 8, 4)
    assert c.k.dtype == torch.float32 and c.length == 0 and c.max_len == 8
    with pytest.raises(ModelError, match="max_len"):
        make(0)


def test_reserve_advance_and_overflow() -> None:
    c = make()
    assert c.reserve(5) == 0
    c.advance(5)
    assert c.reserve(3) == 5
    with pytest.raises(ModelError, match=r"5 \+ 4 tokens exceeds max_len 8"):
        c.reserve(4)


def test_rollback_is_o1_and_keeps_storage() -> None:
    c = make()
    c.k[:, :, :6] = 1.0
    c.advance(6)
    ptr, before = c.k.data_ptr(), c.k.clone()
    c.rollback(2)
    assert c.length == 2
    assert c.k.data_ptr() == ptr and torch.equal(c.k, before)  # nothing copied or cleared
    c.rollback(2)  # to the same length: allowed
    c.rollback(0)
    assert c.length == 0


@pytest.mark.parametrize("bad", [-1, 3])
def test_rollback_out_of_range(bad: int) -> None:
    c = make()
    c.advance(2)
    with pytest.raises(ModelError, match="cannot roll back"):
        c.rollback(bad)
