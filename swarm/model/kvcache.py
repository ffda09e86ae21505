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

Quantized formats (the swarm's ``kv_cache`` invite key, :data:`KV_FORMATS`)
----------------------------------------------------------------------------
``auto`` holds keys and values in the stage's dtype (the behaviour before the key existed).
``int8`` holds each (token, head) vector as int8 with one scale, absmax / 127 (symmetric,
round to nearest); ``fp8`` as float8_e4m3fn with one scale, absmax / 448 (the format's largest
value). Scales are bf16 (a float32 range, 2 bytes) whatever the compute dtype, so the bytes per
token are the same on every peer of a mixed-dtype ring: (head_dim + 2) per vector instead of
2 * head_dim at bf16, 0.516 of it at head_dim 64. A chunk is quantized as it is written, with the
scale as stored (so the rounded scale never pushes a value past the format's range), and
``update`` returns every position so far dequantized to the chunk's dtype (values times scale, in
that dtype): the attention after it is the unquantized code unchanged, and the chunk's own
keys are read back quantized as every later chunk will read them. A vector's quantization
depends on that vector alone, not on how many tokens its chunk held, so a replay, a ring and one
process holding the same stages write the same bytes; rollback stays O(1) (scales are overwritten
with their entries).
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.errors import ModelError

KV_FORMATS = ("auto", "int8", "fp8")  # the invite's kv_cache values (swarm.manifest.schema keeps a copy)
SCALE_DTYPE = torch.bfloat16  # one scale per (token, head) vector: float32's range in 2 bytes
SCALE_BYTES = 2
_QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each format holds


def check_kv_format(kv_cache: str) -> str:
    """``kv_cache`` itself, or ModelError naming the choices."""
    if kv_cache not in KV_FORMATS:
        raise ModelError(f"KV cache format {kv_cache!r}: choose one of {', '.join(KV_FORMATS)}")
    return kv_cache


def kv_bytes_per_token_per_layer(args: Any, kv_cache: str, dtype_bytes: int) -> int:
    """Bytes one cached token costs in one layer of ``args`` (a ModelArgs) in format ``kv_cache``
    at ``dtype_bytes`` per value: the planner's and the capacity's KV arithmetic."""
    if check_kv_format(kv_cache) == "auto":
        return int(args.kv_bytes_per_token_per_layer(dtype_bytes))
    values = int(args.kv_bytes_per_token_per_layer(1))  # keys and values, one byte each
    return values + -(-values // args.head_dim) * SCALE_BYTES  # + a scale per head_dim values


def quantize(x: torch.Tensor, kv_cache: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (codes (..., d) int8 or float8_e4m3fn, scales (..., 1) bf16), one scale per
    vector: absmax / QMAX, quantized with the scale as stored."""
    qmax = _QMAX[kv_cache]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(1e-30).to(SCALE_DTYPE)  # (..., 1)
    y = (xf / scale.float()).clamp(-qmax, qmax)  # (..., d) float32
    if kv_cache == "int8":
        return y.round().to(torch.int8), scale
    return y.to(torch.float8_e4m3fn), scale  # round to nearest even, within range by the clamp


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., d), scales (..., 1) -> (..., d) in ``dtype`` (codes times scale, in dtype)."""
    return codes.to(dtype) * scales.to(dtype)


class KVCache:
    """One session in one stage; the ``update`` half of transformers' ``Cache`` interface."""

    __slots__ = ("length", "max_len", "dtype", "device", "kv_cache", "_k", "_v", "_ks", "_vs", "_pos", "_end")
    is_compileable = False

    def __init__(self, max_len: int, *, dtype: torch.dtype, device: str | torch.device,
                 kv_cache: str = "auto") -> None:
        if max_len <= 0:
            raise ModelError(f"KV cache max_len must be positive, got {max_len}")
        self.kv_cache = check_kv_format(kv_cache)
        self.length = 0
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._ks: dict[int, torch.Tensor] = {}  # quantized formats: each vector's scale (1, KV, max_len, 1)
        self._vs: dict[int, torch.Tensor] = {}
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

    def at(self, pos: int, n: int) -> None:
        """Aim the next ``update`` of every layer at positions ``pos .. pos+n-1`` without moving
        ``length``: a replay's chunk that starts inside what is held (Stage.forward_seq), or one
        of several chunks run through a layer in turn (llama_layers.DecoderLayer.forward_rows)."""
        self._pos, self._end = pos, pos + n

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values (1, KV, T, hd) of this chunk -> all keys/values so far (1, KV, pos+T, hd)."""
        if self.kv_cache != "auto":
            return self._update_quantized(key_states, value_states, layer_idx)
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

    def _update_quantized(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos, end = self._pos, self._end
        if key_states.shape[2] != end - pos:
            raise ModelError(f"layer {layer_idx}: {key_states.shape[2]} new keys for a chunk of {end - pos}")
        code = torch.int8 if self.kv_cache == "int8" else torch.float8_e4m3fn
        out = []
        for new, codes, scales in ((key_states, self._k, self._ks), (value_states, self._v, self._vs)):
            if layer_idx not in codes:
                codes[layer_idx] = self._alloc(new, code)  # (1, KV, max_len, hd)
                scales[layer_idx] = self._alloc(new, SCALE_DTYPE, 1)  # (1, KV, max_len, 1)
            c, s = codes[layer_idx], scales[layer_idx]
            c[:, :, pos:end], s[:, :, pos:end] = quantize(new, self.kv_cache)
            out.append(dequantize(c[:, :, :end], s[:, :, :end], new.dtype))  # (1, KV, end, hd)
        return out[0], out[1]

    def allocate(self, layer_idx: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s whole key and value buffers (1, KV, max_len, hd), allocated here
        if no chunk wrote that layer yet: what the compiled decode step writes into (compiled.py)."""
        if self.kv_cache != "auto":
            raise ModelError(f"a {self.kv_cache} KV cache has no plain buffers to hand out")
        if layer_idx not in self._k:
            like = torch.empty((1, kv_heads, 0, head_dim), dtype=self.dtype, device=self.device)
            self._k[layer_idx], self._v[layer_idx] = self._alloc(like), self._alloc(like)
        return self._k[layer_idx], self._v[layer_idx]

    def _alloc(self, like: torch.Tensor, dtype: torch.dtype | None = None, d: int | None = None) -> torch.Tensor:
        b, h, _, hd = like.shape
        return torch.zeros((b, h, self.max_len, d or hd), dtype=dtype or like.dtype, device=like.device)

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
        held = (*self._k.values(), *self._v.values(), *self._ks.values(), *self._vs.values())
        return sum(t.numel() * t.element_size() for t in held)
