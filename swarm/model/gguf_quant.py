"""GGUF tensors kept compact: Q4_0, Q4_1 and Q4_K blocks repacked straight into int4 groups.

Theory of operation
-------------------
All three formats store, per block of 32 inputs, 4-bit integers ``q`` in [0, 15] and an affine map
back to the weight; each map is torch's int4 convention ``w = (q - 8) · scale + zero`` exactly:

- Q4_0 (18 bytes / 32): ``w = d · (q - 8)``        -> scale = d, zero = 0
- Q4_1 (20 bytes / 32): ``w = d · q + m``          -> scale = d, zero = m + 8d
- Q4_K (144 bytes / 256: 8 sub-blocks of 32 with 6-bit scale ``sc`` and min ``mn``):
  ``w = d · sc · q - dmin · mn``                   -> scale = d·sc, zero = 8·d·sc - dmin·mn

so the integers are copied, never re-rounded, and the group size is 32. The nibble order inside a
block follows ``gguf.quants`` (low nibbles first; Q4_K in chunks of 64), whose dequantization the
tests compare against. Other types are served through a float copy of one tensor that
``quantize_block`` quantizes: F32/F16/BF16, Q8_0 (per-row int8 cannot reuse its per-block
scales), Q5_0/Q5_1/Q5_K/Q6_K (int4 drops their extra bits; int8 keeps them within half a step).
Types below 4 bits (Q2_K, Q3_K, the IQ and TQ families) would grow, or lose values, in our
formats: they are refused with an error naming the tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from swarm.errors import WeightsError
from swarm.model.quant import Int4Groups, check_quant

if TYPE_CHECKING:
    from swarm.model.gguf import GGUFSource

DIRECT_INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
VIA_FLOAT = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)[..., 0]


def repack_int4(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> Int4Groups:
    """Raw blocks (N, bytes per row) of a Q4_0 / Q4_1 / Q4_K tensor -> int4 groups of 32."""
    n, k = shape
    if qtype == T.Q4_K:
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (N, nb)
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))  # (N*nb, 8) each
        sc = sc.reshape(n, -1, 8).astype(np.float32)
        mn = mn.reshape(n, -1, 8).astype(np.float32)
        qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)
        scale = (d[..., None] * sc).reshape(n, -1)
        zero = (8.0 * scale.reshape(n, -1, 8) - dmin[..., None] * mn).reshape(n, -1)
    elif qtype in (T.Q4_0, T.Q4_1):
        size = 18 if qtype == T.Q4_0 else 20
        b = raw.reshape(n, k // 32, size)
        scale = _f16(b[..., 0:2])  # (N, nb)
        zero = np.zeros_like(scale) if qtype == T.Q4_0 else _f16(b[..., 2:4]) + 8.0 * scale
        qs = b[..., size - 16 :].reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)
    else:
        raise ValueError(f"{qtype.name} is not repacked directly")
    return Int4Groups(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
        32,
    )


def compact_weight(source: GGUFSource, name: str, quant: str) -> Int4Groups | None:
    """Int4 groups for a linear weight that ``quant`` can take straight from its GGUF blocks;
    None when it is loaded as float and quantized instead; WeightsError for a type we cannot keep
    compact."""
    check_quant(quant)
    info = source._info(name)
    if quant == "none":
        return None
    if quant == "int4" and info.qtype in DIRECT_INT4 and len(info.shape) == 2:
        g = repack_int4(source.raw(name), info.qtype, (info.shape[0], info.shape[1]))
        order = source.row_order(name, info.shape[0])
        return g if order is None else g.rows(order)
    if info.qtype in DIRECT_INT4 or info.qtype in VIA_FLOAT:
        return None
    ok = ", ".join(t.name for t in (*VIA_FLOAT, *DIRECT_INT4))
    raise WeightsError(
        f"{source.path}: tensor {info.name!r} is stored as {info.qtype.name}, which cannot be kept "
        f"compact as {quant} (it would grow or change); use a GGUF whose layers are {ok}, or "
        f"--quant none"
    )


# ggml types by the compact format of ours that keeps them (gguf_quant's docstring: Q4_* blocks are
# copied into int4 groups; 5 to 8 bits fit int8 within half a step; floats and types below 4 bits
# are held dense)
_KEPT_AS = {**{t: "int4" for t in DIRECT_INT4}, **{t: "int8" for t in (T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)}}


def stored_quant(source: GGUFSource) -> str:
    """The format of ours that keeps every decoder-layer matrix of ``source`` at least as fine as
    stored: "int4" when all are Q4_0/Q4_1/Q4_K, "int8" when the finest are 5 to 8 bits, "none"
    when any is a float or a type below 4 bits (those are served dense)."""
    kinds = {_KEPT_AS.get(source._info(n).qtype, "none")
             for n in source.names() if n.startswith("model.layers.") and len(source.shape(n)) >= 2}  # fmt: skip
    if not kinds or "none" in kinds:
        return "none"
    return "int8" if "int8" in kinds else "int4"


def stored_head_quant(source: GGUFSource) -> str:
    """The format of ours that keeps the LM head of ``source`` (``lm_head.weight``, else the tied
    embedding) as stored: "int8" for 5 to 8 bits, "int4" for Q4_0/Q4_1/Q4_K, else "none"."""
    name = "lm_head.weight" if "lm_head.weight" in source.names() else "model.embed_tokens.weight"
    return _KEPT_AS.get(source._info(name).qtype, "none")
