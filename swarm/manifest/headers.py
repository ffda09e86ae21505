"""Tensor tables read from the first bytes of a weight file: safetensors and GGUF, from bytes.

Theory of operation
-------------------
A peer that fetches its slice of a model reads each weight file's header with one small ranged
read, so these parsers take a *prefix* of the file, never a path. A prefix too short for the
whole header raises :class:`NeedMore` carrying how many bytes would do (exact for safetensors,
whose first 8 bytes give the header length; a doubled guess for GGUF, whose header length is
known only once parsed); the caller reads that much and calls again.

safetensors: ``u64 n`` then ``n`` bytes of JSON ``{name: {dtype, shape, data_offsets}}``; data
offsets count from byte ``8 + n``. GGUF (v2/v3, little-endian): magic, version, tensor count,
metadata key/values, one record per tensor (name, ne[], ggml type, offset), then the data section
at the next multiple of ``general.alignment``. Tensor sizes come from the ``gguf`` package's block
table. Both return :class:`TensorRange` with absolute file offsets and ``header_end`` (the first
byte of the data section): every byte of a file is the header, a tensor, or padding.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from swarm.errors import WeightsError

MAX_HEADER_BYTES = 256 << 20  # a header larger than this is corrupt (llama.cpp's largest: ~20 MB)
_MAX_COUNT = 1 << 24


class NeedMore(Exception):
    """The prefix ends inside the header; ``size`` bytes from the start are (or may be) enough."""

    def __init__(self, size: int) -> None:
        super().__init__(f"need {size} bytes of header")
        self.size = size


@dataclass(frozen=True)
class TensorRange:
    name: str  # as the file names it (GGUF: blk.3.attn_q.weight)
    dtype: str  # safetensors dtype (F32, BF16, ...) or ggml type name (Q4_1, F16, ...)
    shape: tuple[int, ...]  # as the file lists it (GGUF: ne, fastest dimension first)
    start: int  # absolute byte offset in the file
    end: int  # one past the last byte


@dataclass(frozen=True)
class FileTable:
    header_end: int  # first byte of the data section (header + padding before it)
    tensors: tuple[TensorRange, ...]
    metadata: dict[str, Any]  # GGUF key/values or safetensors' __metadata__ (tokenizer arrays dropped)


def parse_safetensors(prefix: bytes, where: str) -> FileTable:
    if len(prefix) < 8:
        raise NeedMore(8)
    (n,) = struct.unpack_from("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise WeightsError(f"{where}: safetensors header length {n} is implausible (corrupt file?)")
    if len(prefix) < 8 + n:
        raise NeedMore(8 + n)
    try:
        header = json.loads(prefix[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{where}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{where}: safetensors header is not a JSON object")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = str(info["dtype"]), tuple(int(x) for x in info["shape"]), info["data_offsets"]
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b):
                raise ValueError(f"data_offsets {a}, {b}")
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{where}: tensor {name}: bad header entry ({e})") from None
        out.append(TensorRange(name, dtype, shape, base + a, base + b))
    out.sort(key=lambda t: t.start)
    meta = header.get("__metadata__") or {}
    return FileTable(base, tuple(out), meta if isinstance(meta, dict) else {})


# ------------------------------------------------------------------------------------- GGUF
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cur:
    def __init__(self, buf: bytes, where: str) -> None:
        self.buf, self.where, self.pos = buf, where, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            if len(self.buf) >= MAX_HEADER_BYTES:
                raise WeightsError(f"{self.where}: GGUF header longer than {MAX_HEADER_BYTES} bytes (corrupt?)")
            raise NeedMore(max(2 * len(self.buf), self.pos + n, 1 << 16))
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = int(self.scalar("<Q"))
        if n > _MAX_COUNT:
            raise WeightsError(f"{self.where}: corrupt GGUF header: {what} = {n}")
        return n

    def string(self) -> str:
        return self.take(self.count("string length")).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.count("array length")
            if itype in _SCALAR:  # skipped in one step: tokenizer scores and types are long
                raw = self.take(n * struct.calcsize(_SCALAR[itype]))
                return list(struct.unpack(f"<{n}{_SCALAR[itype][1]}", raw)) if keep else None
            items = [self.value(itype, keep) for _ in range(n)]
            return items if keep else None
        raise WeightsError(f"{self.where}: corrupt GGUF header: value type {vtype}")


def parse_gguf(prefix: bytes, where: str) -> FileTable:
    """The tensor table of a GGUF file (metadata kept except tokenizer arrays)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cur(prefix, where)
    magic = cur.take(4)
    if magic != b"GGUF":
        raise WeightsError(f"{where}: not a GGUF file (magic {magic!r})")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise WeightsError(f"{where}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.count("tensor count"), cur.count("metadata count")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        v = cur.value(cur.scalar("<I"), keep=not key.startswith("tokenizer.ggml."))
        if v is not None:
            meta[key] = v
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.scalar("<I")
        if not 1 <= dims <= 4:
            raise WeightsError(f"{where}: corrupt GGUF: tensor {name!r} has rank {dims}")
        ne = tuple(int(cur.scalar("<Q")) for _ in range(dims))
        raw.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise WeightsError(f"{where}: corrupt GGUF: general.alignment = {align}")
    data = (cur.pos + align - 1) // align * align
    out = []
    for name, ne, qid, off in raw:
        try:
            qtype = GGMLQuantizationType(qid)
        except ValueError:
            raise WeightsError(f"{where}: tensor {name!r} has unknown ggml type {qid}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise WeightsError(f"{where}: tensor {name!r}: row {ne[0]} is not a multiple of {block}")
        start = data + int(off)
        out.append(TensorRange(name, qtype.name, ne, start, start + math.prod(ne) // block * size))
    out.sort(key=lambda t: t.start)
    return FileTable(data, tuple(out), meta)


def parse_header(kind: str, prefix: bytes, where: str) -> FileTable:
    return parse_gguf(prefix, where) if kind == "gguf" else parse_safetensors(prefix, where)
