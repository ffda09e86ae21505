"""Per-session KV cache of one stage: preallocated per layer, appended in place, rolled back in O(1).

Theory of operation
-------------------
transformers' attention modules call ``cache.update(keys, values, layer_idx)`` with the new
chunk's keys and values and attend to whatever it returns. This cache answers that call: layer
``layer_idx`` owns two tensors (1, KV, max_len, head_dim), allocated on its first update (so the
shapes are whatever the family's attention produces: GQA, MLA's two differently shaped parts),
the chunk is written at ``[pos : pos + T]`` and the view ``[:pos + T]`` is returned. The stage
calls :meth:`begin` with ``pos`` before running its layers and :meth:`advance` after.

``length`` is the number of valid positions; entries at and after it are garbage and never read,
because attention only sees ``[:length + T]`` after the T new entries were written there.
Rolling back (a speculative chunk whose tail was rejected, or a replay after a re-plan) only moves
``length`` back: O(1), no copy, and the next forward overwrites the stale entries. Sliding-window
layers keep every position too; their window is applied by the stage's attention mask, so rollback
is the same truncation for them.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.errors import ModelError


class KVCache:
    """One session in one stage; the ``update`` half of transformers' ``Cache`` interface."""

    __slots__ = ("length", "max_len", "dtype", "device", "_k", "_v", "_pos", "_end")
    is_compileable = False

    def __init__(self, max_len: int, *, dtype: torch.dtype, device: str | torch.device) -> None:
        if max_len <= 0:
            raise ModelError(f"KV cache max_len must be positive, got {max_len}")
        self.length = 0
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._pos = 0
        self._end = 0

    def reserve(self, n: int) -> int:
        """Check room for ``n`` more entries; return the position they start at."""
        if self.length + n > self.max_len:
            raise ModelError(
                f"KV cache full: {self.length} + {n} tokens exceeds max_len {self.max_len} "
                "(open the session with a larger max_len)"
            )
        return self.length

    def begin(self, n: int) -> int:
        """Start a chunk of ``n`` positions at ``length``; return its first position."""
        pos = self.reserve(n)
        self._pos, self._end = pos, pos + n
        return pos

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values (1, KV, T, hd) of this chunk -> all keys/values so far (1, KV, pos+T, hd)."""
        k = self._k.get(layer_idx)
        if k is None:
            k = self._k[layer_idx] = self._alloc(key_states)
            self._v[layer_idx] = self._alloc(value_states)
        v = self._v[layer_idx]
        pos, end = self._pos, self._end
        if key_states.shape[2] != end - pos:
            raise ModelError(f"layer {layer_idx}: {key_states.shape[2]} new keys for a chunk of {end - pos}")
        k[:, :, pos:end] = key_states
        v[:, :, pos:end] = value_states
        return k[:, :, :end], v[:, :, :end]

    def _alloc(self, like: torch.Tensor) -> torch.Tensor:
        b, h, _, d = like.shape
        return torch.zeros((b, h, self.max_len, d), dtype=like.dtype, device=like.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every entry at position >= ``length`` (O(1))."""
        if not 0 <= length <= self.length:
            raise ModelError(f"cannot roll back a KV cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))
