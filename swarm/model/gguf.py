"""GGUF files (llama.cpp), single or split, as a tensor source with Hugging Face names and layout.

Theory of operation
-------------------
A GGUF file is a small header (metadata key/values, then one info record per tensor: name, shape,
ggml type, offset) followed by an aligned data section. We parse the header ourselves with
``struct`` over an ``mmap`` (the PyPI ``gguf`` reader builds numpy views for every token of the
vocabulary and takes seconds to open a 100 MB file; this parser takes milliseconds), and check
that every tensor's bytes lie inside the file, so a truncated file fails at open, naming the
first tensor that is cut; the map is closed once the header is parsed. Tensor bytes stay on disk
(or in the page cache) until ``load(name)`` asks for one tensor: only then are its bytes read
into a buffer of our own (weights.FileReader: a map's touched pages would stay resident, see
weights.py) and dequantized (``gguf.quants.dequantize``, which knows every ggml
type the ``gguf`` package supports: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, K-quants, IQ-quants).
A Stage of 7 layers out of 30 therefore reads and dequantizes only its own 7 layers.

Layout differences undone here, so callers see exactly what a Hugging Face checkpoint holds:

- GGUF shapes are listed fastest-dimension first (ggml ``ne``); HF shapes are the reverse.
- Names, and what llama.cpp's converter did per architecture (Q/K rows permuted for the Llama
  family's interleaved RoPE, Gemma's norms stored as 1 + w, MoE experts stacked into one 3-D
  tensor): gguf_archs.py. The permutation within each head was ``reshape(heads, 2, d/2)
  .swapaxes(1, 2)``; we apply the inverse ``reshape(heads, d/2, 2).swapaxes(1, 2)``, Q with the
  attention head count, K with the KV head count.
- Llama 3 rope scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency factors, not
  as parameters; we recover the parameters by recomputing the factors from candidate settings and
  accepting only an exact match (gguf_archs.py).

A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00003.gguf`` ...) is one source: every
split is a complete GGUF file holding some of the tensors, the first also holds the metadata, and
each says which split it is (``split.no`` from 0, ``split.count``); giving any split opens them all.
Conversion to a Hugging Face directory: gguf_convert.py.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from swarm.errors import ConfigError, WeightsError
from swarm.model.gguf_archs import arch_of, config_from, hf_names
from swarm.model.weights import FileReader

# --------------------------------------------------------------------------------------------
# Header parsing

_MAGIC = b"GGUF"
_MAX_COUNT = 1 << 24  # sanity cap on tensor/kv/array counts in a header (corrupt files)
_MAX_DIMS = 4
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NP_SCALARS: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
DEQUANT_CHUNK_BYTES = 8 << 20  # float32 output dequantized at a time (GGUFFile.dequantized)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str  # the GGUF name, e.g. "blk.3.attn_q.weight"
    shape: tuple[int, ...]  # HF order (slowest dimension first)
    qtype: GGMLQuantizationType
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


class _Cursor:
    """Little-endian reader over a buffer; any overrun raises WeightsError naming the file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise WeightsError(
                f"{self.path}: truncated or corrupt GGUF header while reading {what} "
                f"at byte {self.pos} (file has {self.size} bytes)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def count(self, what: str) -> int:
        n = self.scalar("<Q", what)
        if n > _MAX_COUNT:
            raise WeightsError(f"{self.path}: corrupt GGUF header: {what} = {n} is implausible")
        return int(n)

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"value of {key!r}")
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype == _ARRAY:
            itype = self.scalar("<I", f"array type of {key!r}")
            n = self.count(f"array length of {key!r}")
            if itype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[itype])
                self._need(n * dt.itemsize, f"array {key!r}")
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return [bool(x) for x in arr] if itype == 7 else arr.tolist()
            return [self.value(itype, key) for _ in range(n)]
        raise WeightsError(
            f"{self.path}: corrupt GGUF header: unknown value type {vtype} for {key!r}"
        )


class GGUFFile:
    """The parsed header of a GGUF file, and a reader of its tensors' bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise WeightsError(f"{self.path}: empty file, not a GGUF model")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot open GGUF file: {e.strerror or e}") from e
        try:
            self._parse(mm)
        finally:
            mm.close()  # the header is parsed into Python objects; tensors are read (module doc)
        try:
            self._reader = FileReader(self.path)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot open GGUF file: {e.strerror or e}") from e

    def _parse(self, mm: mmap.mmap) -> None:
        cur = _Cursor(mm, self.path)
        cur._need(4, "magic")
        magic = bytes(mm[:4])
        if magic != _MAGIC:
            raise WeightsError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.scalar("<I", "version")
        if self.version not in (2, 3):
            hint = " (big-endian files are not supported)" if self.version > 0xFFFF else ""
            raise WeightsError(f"{self.path}: unsupported GGUF version {self.version}{hint}")
        n_tensors = cur.count("tensor count")
        n_kv = cur.count("metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.scalar("<I", f"type of {key!r}")
            self.metadata[key] = cur.value(vtype, key)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.scalar("<I", f"rank of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise WeightsError(f"{self.path}: corrupt GGUF: tensor {name!r} has rank {n_dims}")
            ne = tuple(int(cur.scalar("<Q", f"shape of {name!r}")) for _ in range(n_dims))
            qtype = cur.scalar("<I", f"type of tensor {name!r}")
            offset = cur.scalar("<Q", f"offset of tensor {name!r}")
            raw.append((name, ne, qtype, offset))
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise WeightsError(f"{self.path}: corrupt GGUF: general.alignment = {align}")
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, qtype_id, offset in raw:
            try:
                qtype = GGMLQuantizationType(qtype_id)
            except ValueError:
                raise WeightsError(
                    f"{self.path}: tensor {name!r} has unknown ggml type {qtype_id}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elem = math.prod(ne)
            if ne[0] % block:
                raise WeightsError(
                    f"{self.path}: tensor {name!r}: row of {ne[0]} is not a multiple of the "
                    f"{qtype.name} block size {block}"
                )
            nbytes = n_elem // block * type_size
            start = data_start + offset
            if start + nbytes > cur.size:
                raise WeightsError(
                    f"{self.path}: truncated GGUF: tensor {name!r} needs bytes up to "
                    f"{start + nbytes}, the file has {cur.size}"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), qtype, start, nbytes)

    def raw(self, info: GGUFTensorInfo, expert: int | None = None) -> np.ndarray:
        """The tensor's bytes, read into a fresh uint8 array shaped (rows..., bytes_per_row); with
        ``expert``, only that slice of a stacked (E, ...) tensor (its bytes lie together)."""
        offset, nbytes, rows = info.offset, info.nbytes, info.shape[:-1]
        if expert is not None:
            nbytes //= info.shape[0]
            offset, rows = offset + expert * nbytes, rows[1:]
        what = f"tensor {info.name!r}" + ("" if expert is None else f" expert {expert}")
        arr = self._reader.tensor(offset, nbytes, what).numpy()
        return arr.reshape(*rows, -1) if rows else arr

    def dequantized(self, info: GGUFTensorInfo, expert: int | None = None) -> np.ndarray:
        """float32 array in HF shape (a fresh, writable copy); with ``expert``, only that slice of a
        stacked (E, ...) experts tensor (its rows are stored apart from the other experts').

        Rows are dequantized a few MB at a time into the one output array: ``gguf``'s numpy
        dequantizers make several float temporaries the size of what they are given, which for
        a whole embedding (a Q8_0 one of the bundled model: 113 MB as float32) came to 2.3 times
        the tensor beside the output (measured: a head's load peaked 382 MB over its start). The
        stored bytes are read a chunk at a time too: Gemma 3 270M's head (262k x 640) read whole
        beside its 671 MB output peaked 270 MB over what it holds, and a head-only coordinator at
        its offer was OOM-killed loading it."""
        offset, nbytes = info.offset, info.nbytes
        shape = info.shape if expert is None else info.shape[1:]
        if expert is not None:
            nbytes //= info.shape[0]
            offset += expert * nbytes
        n_rows = math.prod(shape[:-1])
        row_bytes = nbytes // max(1, n_rows)
        out = np.empty((n_rows, math.prod(shape) // max(1, n_rows)), dtype=np.float32)
        step = max(1, DEQUANT_CHUNK_BYTES // max(1, out.shape[1] * 4))
        what = f"tensor {info.name!r}" + ("" if expert is None else f" expert {expert}")
        try:
            for r in range(0, n_rows, step):  # the stored bytes too, a chunk at a time (not the whole tensor beside ``out``)
                n = min(step, n_rows - r)
                rows = self._reader.tensor(offset + r * row_bytes, n * row_bytes, what).numpy().reshape(n, row_bytes)
                out[r : r + n] = self._rows_as_float(rows, info.qtype)
        except (NotImplementedError, ValueError) as e:
            raise WeightsError(
                f"{self.path}: cannot dequantize tensor {info.name!r} ({info.qtype.name}): {e}"
            ) from e
        return out.reshape(shape)

    @staticmethod
    def _rows_as_float(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        """(r, bytes_per_row) stored bytes -> (r, values_per_row) floats."""
        if qtype == GGMLQuantizationType.F64:
            return data.view("<f8")
        if qtype in _INT_TYPES:
            return data.view(_INT_TYPES[qtype])
        return dequantize(data, qtype)  # type: ignore[no-any-return]

    def field(self, key: str) -> Any:
        if key not in self.metadata:
            raise ConfigError(f"{self.path}: GGUF metadata has no {key!r}")
        return self.metadata[key]

    def number(self, key: str, default: float | None = None, *, integer: bool = True) -> Any:
        """A numeric metadata value (ConfigError naming the key if missing or not a number)."""
        v = self.metadata.get(key, default) if default is not None else self.field(key)
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (integer and not isinstance(v, int))
        ):
            raise ConfigError(f"{self.path}: GGUF metadata {key!r} = {v!r} is not a valid number")
        return int(v) if integer else float(v)


_INT_TYPES = {
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}

# --------------------------------------------------------------------------------------------
# Split files

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_files(path: str | Path) -> list[Path]:
    """The files of a GGUF model: ``path`` itself, or every split of a ``*-0000K-of-0000N.gguf``
    set (any of them may be given) in order; WeightsError naming a missing split."""
    p = Path(path)
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise WeightsError(f"{p}: split number {int(m['no'])} is outside 1..{count}")
    files = [p.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{p}: split GGUF file {f.name} (of {count}) is missing")
    return files


def _open_splits(path: Path) -> list[GGUFFile]:
    files = [GGUFFile(f) for f in split_files(path)]
    if len(files) > 1:
        for i, f in enumerate(files):
            no, count = f.metadata.get("split.no"), f.metadata.get("split.count")
            if no != i or count != len(files):
                raise WeightsError(
                    f"{f.path}: its metadata says split {no} of {count}, its name split {i} of {len(files)}"
                    " (split.no counts from 0)"
                )
    return files


# --------------------------------------------------------------------------------------------
# The tensor source


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: (n_heads*d, ...) interleaved -> rotate-half rows."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _Entry:
    file: GGUFFile
    info: GGUFTensorInfo
    expert: int | None  # the expert's slice of a stacked experts tensor, or the whole tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape if self.expert is None else self.info.shape[1:]


class GGUFSource:
    """A TensorSource over a GGUF file (or a split set): HF names and layout, dequantized per
    tensor on demand (an expert's slice of a stacked tensor without the other experts')."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.files = _open_splits(self.path)
        self.file = self.files[0]  # the metadata (a split set keeps it in the first file)
        prefix, self.arch = arch_of(self.file)
        self.architecture = prefix
        self.n_heads = self.file.number(f"{prefix}.attention.head_count")
        self.n_kv_heads = self.file.number(f"{prefix}.attention.head_count_kv", self.n_heads)
        if self.n_heads <= 0 or self.n_kv_heads <= 0:
            raise ConfigError(f"{self.path}: GGUF head counts must be positive")
        self._by_hf: dict[str, _Entry] = {}
        for f in self.files:
            for name, info in f.tensors.items():
                try:
                    hf = hf_names(self.arch, name, info.shape)
                except KeyError:
                    raise WeightsError(
                        f"{f.path}: GGUF tensor {name!r} has no Hugging Face counterpart for "
                        f"architecture {prefix!r}"
                    ) from None
                for hf_name, expert in hf:
                    if hf_name in self._by_hf:
                        raise WeightsError(f"{f.path}: GGUF tensor {name!r} appears twice in the split set")
                    self._by_hf[hf_name] = _Entry(f, info, expert)
        if "model.embed_tokens.weight" not in self._by_hf:
            raise WeightsError(f"{self.path}: GGUF file has no tensor 'token_embd.weight'")

    def names(self) -> list[str]:
        return list(self._by_hf)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._by_hf[name]
        except KeyError:
            raise WeightsError(f"{self.path}: no tensor {name!r} in this GGUF file") from None

    def _info(self, name: str) -> GGUFTensorInfo:
        return self._entry(name).info

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def gguf_type(self, name: str) -> str:
        """The ggml storage type of a tensor, e.g. 'Q4_1' (for reports and tests)."""
        return self._info(name).qtype.name

    def raw(self, name: str) -> np.ndarray:
        """The stored blocks of one whole (not stacked) tensor, shaped (rows..., bytes_per_row)."""
        e = self._entry(name)
        if e.expert is not None:
            raise WeightsError(f"{self.path}: tensor {name!r} is one expert of {e.info.name!r}")
        return e.file.raw(e.info)

    def row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Row indices that undo llama.cpp's Q/K permutation of tensor ``name`` (None: not permuted)."""
        if not (self.arch.permuted and (".q_proj." in name or ".k_proj." in name)):
            return None
        heads = self.n_heads if ".q_proj." in name else self.n_kv_heads
        try:
            return unpermute_rope_rows(torch.arange(rows), heads)
        except ValueError as e:
            raise WeightsError(f"{self.path}: tensor {self._info(name).name!r}: {e}") from e

    def compact(self, name: str, quant: str) -> Any:
        """Int4 groups read straight from the blocks, or None (see ``swarm.model.gguf_quant``)."""
        from swarm.model.gguf_quant import compact_weight

        return compact_weight(self, name, quant)

    def load(self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        e = self._entry(name)
        t = torch.from_numpy(e.file.dequantized(e.info, e.expert))
        order = self.row_order(name, t.shape[0])
        if order is not None:
            t = t[order]
        if self.arch.norm_offset and e.info.name.endswith("norm.weight"):
            t = t - self.arch.norm_offset
        return t.to(device=device, dtype=dtype)


def config_from_gguf(path: Path | str) -> dict[str, Any]:
    """An HF-style config.json dict from a GGUF file's metadata (ConfigError naming a missing key)."""
    return config_from(_open_splits(Path(path))[0])
