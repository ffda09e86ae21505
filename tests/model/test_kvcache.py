"""KVCache: transformers' update() contract, bounded, allocated once per layer, O(1) rollback."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ModelError
from swarm.model.kvcache import KVCache


def make(max_len: int = 8) -> KVCache:
    return KVCache(max_len, dtype=torch.float32, device="cpu")


def kv(t: int, fill: float = 1.0, heads: int = 3, hd: int = 4) -> torch.Tensor:
    return torch.full((1, heads, t, hd), fill)


def test_update_appends_and_returns_everything_so_far() -> None:
    c = make()
    with pytest.raises(ModelError, match="max_len"):
        make(0)
    assert c.begin(5) == 0
    k, v = c.update(kv(5, 1.0), kv(5, 2.0), layer_idx=7)  # layers keep their global index
    assert k.shape == (1, 3, 5, 4) and torch.equal(v, kv(5, 2.0))
    c.advance(5)
    assert c.begin(2) == 5
    k, _ = c.update(kv(2, 3.0), kv(2, 3.0), 7)
    assert k.shape == (1, 3, 7, 4) and torch.equal(k[:, :, 5:], kv(2, 3.0))
    # MLA-style layers cache differently shaped parts: allocated per layer from the first update
    k2, v2 = c.update(kv(2, heads=1, hd=6), kv(2, heads=1, hd=2), 8)
    assert k2.shape == (1, 1, 7, 6) and v2.shape == (1, 1, 7, 2)
    with pytest.raises(ModelError, match="new keys for a chunk"):
        c.update(kv(3), kv(3), 7)


def test_reserve_and_overflow() -> None:
    c = make()
    c.begin(5)
    c.advance(5)
    assert c.reserve(3) == 5
    with pytest.raises(ModelError, match=r"5 \+ 4 tokens exceeds max_len 8"):
        c.begin(4)


def test_rollback_is_o1_and_keeps_storage() -> None:
    c = make()
    c.begin(6)
    k, _ = c.update(kv(6), kv(6), 0)
    c.advance(6)
    ptr, before = k.data_ptr(), k.clone()
    c.rollback(2)
    assert c.length == c.get_seq_length() == 2
    c.begin(1)
    k, _ = c.update(kv(1, 9.0), kv(1, 9.0), 0)
    assert k.data_ptr() == ptr and k.shape[2] == 3  # same storage, only the 3 valid positions seen
    assert torch.equal(k[:, :, :2], before[:, :, :2]) and torch.equal(k[:, :, 2:], kv(1, 9.0))
    c.rollback(0)
    assert c.length == 0


@pytest.mark.parametrize("bad", [-1, 3])
def test_rollback_out_of_range(bad: int) -> None:
    c = make()
    c.advance(2)
    with pytest.raises(ModelError, match="cannot roll back"):
        c.rollback(bad)
