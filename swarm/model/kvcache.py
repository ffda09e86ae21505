"""Per-session KV cache of one stage: preallocated, appended in place, rolled back in O(1).

Theory of operation
-------------------
A session owns two tensors ``k`` and ``v`` of shape (n_layers_in_stage, n_kv_heads, max_len,
head_dim), allocated once when the session opens. ``length`` is the number of valid positions;
entries at and after ``length`` are garbage and never read, because attention only looks at
``[:length + T]`` after writing the T new entries at ``[length:length + T]``. Rolling back (a
speculative chunk whose tail was rejected) therefore only moves ``length`` back: O(1), no copy,
and the next forward overwrites the stale entries.
"""

from __future__ import annotations

import torch

from swarm.errors import ModelError


class KVCache:
    """One session in one stage."""

    __slots__ = ("k", "v", "length", "max_len")

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if max_len <= 0:
            raise ModelError(f"KV cache max_len must be positive, got {max_len}")
        shape = (n_layers, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def reserve(self, n: int) -> int:
        """Check room for ``n`` more entries; return the position they start at."""
        if self.length + n > self.max_len:
            raise ModelError(
                f"KV cache full: {self.length} + {n} tokens exceeds max_len {self.max_len} "
                "(open the session with a larger max_len)"
            )
        return self.length

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every entry at position >= ``length`` (O(1))."""
        if not 0 <= length <= self.length:
            raise ModelError(f"cannot roll back a KV cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
