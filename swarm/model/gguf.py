"""GGUF files (llama.cpp) as a tensor source with Hugging Face names, and conversion to HF layout.

Theory of operation
-------------------
A GGUF file is a small header (metadata key/values, then one info record per tensor: name, shape,
ggml type, offset) followed by an aligned data section. We parse the header ourselves with
``struct`` over an ``mmap`` (the PyPI ``gguf`` reader builds numpy views for every token of the
vocabulary and takes seconds to open a 100 MB file; this parser takes milliseconds), and check
that every tensor's bytes lie inside the file, so a truncated file fails at open, naming the
first tensor that is cut. Tensor bytes stay in the page cache until ``load(name)`` asks for one
tensor: only then is that tensor dequantized (``gguf.quants.dequantize``, which knows every ggml
type the ``gguf`` package supports: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, K-quants, IQ-quants).
A Stage of 7 layers out of 30 therefore reads and dequantizes only its own 7 layers.

Layout differences undone here, so callers see exactly what a Hugging Face checkpoint holds:

- GGUF shapes are listed fastest-dimension first (ggml ``ne``); HF shapes are the reverse.
- llama.cpp's converter permutes the rows of Q and K (weights and biases) of the ``llama``
  architecture so that its "normal" RoPE rotates interleaved pairs (x0, x1), (x2, x3)...; HF rotates
  halves (x_i, x_{i+d/2}). Within each head the converter reorders rows as
  ``reshape(heads, 2, d/2).swapaxes(1, 2)``; we apply the inverse ``reshape(heads, d/2, 2)
  .swapaxes(1, 2)``. Q uses the attention head count, K the KV head count. ``qwen2`` GGUFs are
  written with NeoX RoPE (already rotate-half) and are not permuted.
- Llama 3 rope scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency factors, not
  as parameters; we recover the parameters by recomputing the factors from candidate settings and
  accepting only an exact match.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from swarm.errors import ConfigError, WeightsError
from swarm.model.tokenizer import tokenizer_files_from_gguf

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
    """The parsed header of a GGUF file plus a read-only memory map of its data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise WeightsError(f"{self.path}: empty file, not a GGUF model")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot open GGUF file: {e.strerror or e}") from e
        cur = _Cursor(self._mm, self.path)
        cur._need(4, "magic")
        magic = bytes(self._mm[:4])
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

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a zero-copy uint8 view, shaped (rows..., bytes_per_row)."""
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1]
        return arr.reshape(*rows, -1) if rows else arr

    def dequantized(self, info: GGUFTensorInfo) -> np.ndarray:
        """float32 array in HF shape (a fresh, writable copy)."""
        data = self.raw(info)
        try:
            if info.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                out = dequantize(data, info.qtype)
            elif info.qtype == GGMLQuantizationType.F64:
                out = data.view("<f8").astype(np.float32)
            elif info.qtype in _INT_TYPES:
                out = data.view(_INT_TYPES[info.qtype]).astype(np.float32)
            else:
                out = dequantize(data, info.qtype)
            return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)
        except (NotImplementedError, ValueError) as e:
            raise WeightsError(
                f"{self.path}: cannot dequantize tensor {info.name!r} ({info.qtype.name}): {e}"
            ) from e

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
# Architectures and tensor names

# gguf arch -> (HF architectures[0], model_type, Q/K rows permuted by llama.cpp)
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SKIPPED = {"rope_freqs.weight"}  # folded into config.json's rope_scaling


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name for a GGUF tensor name; None for tensors HF has no counterpart for by design."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in _BLOCK_NAMES
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise KeyError(gguf_name)


def _architecture(f: GGUFFile) -> str:
    arch = f.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{f.path}: GGUF metadata has no 'general.architecture'")
    if arch not in _ARCHS:
        raise ConfigError(
            f"{f.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHS))})"
        )
    return arch


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: (n_heads*d, ...) interleaved -> rotate-half rows."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


class GGUFSource:
    """A TensorSource over a GGUF file: HF names and layout, dequantized per tensor on demand."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.architecture = _architecture(self.file)
        _, _, self._permuted = _ARCHS[self.architecture]
        prefix = self.architecture
        self.n_heads = self.file.number(f"{prefix}.attention.head_count")
        self.n_kv_heads = self.file.number(f"{prefix}.attention.head_count_kv", self.n_heads)
        if self.n_heads <= 0 or self.n_kv_heads <= 0:
            raise ConfigError(f"{self.path}: GGUF head counts must be positive")
        self._by_hf: dict[str, GGUFTensorInfo] = {}
        for name, info in self.file.tensors.items():
            try:
                hf = hf_tensor_name(name)
            except KeyError:
                raise WeightsError(
                    f"{self.path}: GGUF tensor {name!r} has no Hugging Face counterpart for "
                    f"architecture {self.architecture!r}"
                ) from None
            if hf is not None:
                self._by_hf[hf] = info
        if "model.embed_tokens.weight" not in self._by_hf:
            raise WeightsError(f"{self.path}: GGUF file has no tensor 'token_embd.weight'")

    def names(self) -> list[str]:
        return list(self._by_hf)

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._by_hf[name]
        except KeyError:
            raise WeightsError(f"{self.path}: no tensor {name!r} in this GGUF file") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def gguf_type(self, name: str) -> str:
        """The ggml storage type of a tensor, e.g. 'Q4_1' (for reports and tests)."""
        return self._info(name).qtype.name

    def row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Row indices that undo llama.cpp's Q/K permutation of tensor ``name`` (None: not permuted)."""
        if not (self._permuted and (".q_proj." in name or ".k_proj." in name)):
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

    def load(
        self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        info = self._info(name)
        t = torch.from_numpy(self.file.dequantized(info))
        if self._permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.n_heads if ".q_proj." in name else self.n_kv_heads
            try:
                t = unpermute_rope_rows(t, heads)
            except ValueError as e:
                raise WeightsError(f"{self.path}: tensor {info.name!r}: {e}") from e
        return t.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# config.json from metadata


def _llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _rope_scaling(f: GGUFFile, prefix: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = f.metadata.get(f"{prefix}.rope.scaling.type")
    if kind == "linear":
        return {
            "rope_type": "linear",
            "factor": f.number(f"{prefix}.rope.scaling.factor", integer=False),
        }
    if kind not in (None, "none"):
        raise ConfigError(
            f"{f.path}: rope scaling {kind!r} ({prefix}.rope.scaling.type) is not supported"
        )
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    factors = f.dequantized(info).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    # (orig, low, high) and (k*orig, k*low, k*high) give identical factors: prefer low = 1, high = 4
    for low in (1.0, 2.0):
        for high in (4.0, 8.0, 2.0):
            for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
                want = _llama3_rope_factors(theta, head_dim, factor, low, high, orig)
                if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-5):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise ConfigError(f"{f.path}: rope_freqs.weight does not match any llama3 rope scaling we know")


def _config(f: GGUFFile) -> dict[str, Any]:
    arch = _architecture(f)
    hf_arch, model_type, _ = _ARCHS[arch]

    def need(key: str) -> int:
        v = f.number(f"{arch}.{key}")
        if v <= 0:
            raise ConfigError(f"{f.path}: GGUF metadata '{arch}.{key}' = {v} must be positive")
        return int(v)

    hidden = need("embedding_length")
    n_heads = need("attention.head_count")
    n_kv = f.number(f"{arch}.attention.head_count_kv", n_heads)
    head_dim = f.number(f"{arch}.attention.key_length", hidden // n_heads)
    theta = f.number(f"{arch}.rope.freq_base", 10000.0, integer=False)
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise WeightsError(f"{f.path}: GGUF file has no tensor 'token_embd.weight'")
    vocab = f.number(f"{arch}.vocab_size", embd.shape[0])
    if vocab != embd.shape[0]:
        raise ConfigError(
            f"{f.path}: {arch}.vocab_size = {vocab} but token_embd.weight has {embd.shape[0]} rows"
        )
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f.number(f"{arch}.attention.layer_norm_rms_epsilon", integer=False),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(f, arch, theta, head_dim),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        cfg["mlp_bias"] = False
    for key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in f.metadata:
            cfg[hf_key] = f.number(f"tokenizer.ggml.{key}")
    return cfg


def config_from_gguf(path: Path | str) -> dict[str, Any]:
    """An HF-style config.json dict from a GGUF file's metadata (ConfigError naming a missing key)."""
    return _config(GGUFFile(path))


# --------------------------------------------------------------------------------------------
# Conversion to a Hugging Face directory

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _write_safetensors(
    path: Path, source: GGUFSource, names: list[str], dtype: torch.dtype, step: Callable[[], None]
) -> None:
    """Stream tensors into a safetensors file one at a time (peak memory: one tensor)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": source.path.name}}
    pos = 0
    for name in names:
        shape = source.shape(name)
        n = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(hbytes)))
        out.write(hbytes)
        for name in names:
            t = source.load(name, dtype).contiguous()  # HF shape
            out.write(t.view(torch.uint8).numpy().tobytes())
            step()
        out.flush()
        os.fsync(out.fileno())


def convert_gguf_to_hf(
    gguf_path: Path | str,
    out_dir: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write an HF-style directory for a GGUF model; atomic (built in a temp dir, then renamed).

    Files: config.json, model.safetensors (``dtype``), tokenizer.json, tokenizer_config.json
    (with chat_template), generation_config.json. ``progress(done, total)`` counts tensors plus one
    step for the tokenizer. An existing ``out_dir`` is replaced.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TORCH_NAMES.values())}, not {dtype}")
    source = GGUFSource(gguf_path)
    out = Path(out_dir)
    cfg = _config(source.file)
    cfg["torch_dtype"] = _TORCH_NAMES[dtype]
    names = source.names()
    total, done = len(names) + 1, 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    tok, tcfg, extra_eos = tokenizer_files_from_gguf(
        source.file.metadata, where=str(source.path), max_len=cfg["max_position_embeddings"]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "tokenizer.json").write_text(tok, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n"
        )
        eos_ids = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
        eos_ids += [i for i in extra_eos if i not in eos_ids]
        if len(eos_ids) > 1:
            cfg["eos_token_id"] = eos_ids
        gen: dict[str, Any] = {"_from_model_config": True}
        if "bos_token_id" in cfg:
            gen["bos_token_id"] = cfg["bos_token_id"]
        if eos_ids:
            gen["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        if "pad_token_id" in cfg:
            gen["pad_token_id"] = cfg["pad_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        step()
        _write_safetensors(tmp / "model.safetensors", source, names, dtype, step)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
