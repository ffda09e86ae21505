"""Tensor sources: read a checkpoint's tensors one by one, by Hugging Face name.

Theory of operation
-------------------
A stage must load only the tensors of its own layers, so nothing here reads a whole file:
``SafetensorsSource`` checks headers with ``safetensors.safe_open`` and reads just the tensors
asked for. A sharded checkpoint is read through its ``model.safetensors.index.json`` and a shard
file is opened only when one of its tensors is first needed. GGUF files go through
``swarm.model.gguf`` (imported lazily, so this module works without it).

Tensor bytes are *read* (:class:`FileReader`) into buffers the caller owns, never taken from a
memory map: every page of a mapped file that a load touches counts in the process's resident
memory (RssFile, and so VmHWM) until the map goes, and a node keeps its checkpoint open for the
next re-plan. Measured on the bundled model (10 of 30 layers, int4 from bf16 safetensors): a
mapped load left 78 MB of file pages resident beside the 25 MB block it built, and each re-plan
added the pages of the layers it moved; read, the bytes pass through the page cache, which the
kernel reclaims at will, and the process keeps only what it built. No budget (planner/budget.py)
counts those pages, so a peer would otherwise go over its offer by about the size of its block
as stored on disk.

Every foreign failure (safetensors' Rust errors, OS errors, bad JSON) becomes a
:class:`swarm.errors.WeightsError` naming the file and, when known, the tensor. A truncated file is
diagnosed by reading its header ourselves and naming the first tensor whose bytes run past the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from swarm.errors import ConfigError, WeightsError
from swarm.model.config import ModelArgs, read_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@runtime_checkable
class TensorSource(Protocol):
    """Tensors of one checkpoint by Hugging Face name (``model.layers.3.self_attn.q_proj.weight``)."""

    path: Path

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def load(
        self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor: ...


@dataclass
class Checkpoint:
    path: Path
    args: ModelArgs
    source: TensorSource
    config_sha256: str


# ------------------------------------------------------------------------------ reading bytes
class FileReader:
    """Byte ranges of one file read into buffers the caller owns (see the module doc for why not
    a memory map). Thread-safe: one read at a time seeks and fills."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 (held open until close())
        self._lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview, what: str) -> None:
        """Fill ``out`` (a writable byte view) from ``offset``; WeightsError if the file ends first."""
        out = out.cast("B")
        with self._lock:
            self._f.seek(offset)
            got = 0
            while got < len(out):
                n = self._f.readinto(out[got:])
                if not n:
                    raise WeightsError(f"{self.path}: {what}: file ends at byte {offset + got}, "
                                       f"{len(out) - got} bytes short (truncated since it was opened?)")  # fmt: skip
                got += n

    def tensor(self, offset: int, nbytes: int, what: str) -> torch.Tensor:
        """``nbytes`` from ``offset`` as a fresh uint8 tensor."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.read_into(offset, buf.numpy().data, what)
        return buf

    def close(self) -> None:
        self._f.close()


# ------------------------------------------------------------------------------ safetensors
# safetensors' dtype names -> torch (what a checkpoint may hold; another falls back to safe_open)
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass
class _Shard:
    """One open safetensors file: safe_open's handle (it checked the header), our reader, and
    where each tensor's bytes lie (name -> (dtype, shape, absolute offset, nbytes))."""

    handle: Any
    reader: FileReader
    where: dict[str, tuple[str, tuple[int, ...], int, int]]


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset its data starts at (OSError, ValueError)."""
    with file.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + n


class SafetensorsSource:
    """A single ``model.safetensors`` or a sharded set described by an index json.

    ``path`` is the directory; files are opened lazily and kept open (memory-mapped) for reuse.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        single = self.path / SINGLE_FILE
        index = self.path / INDEX_FILE
        self._shards: dict[Path, _Shard] = {}
        if index.is_file():
            self._index_file: Path | None = index
            self._where = self._load_index(index)
        elif single.is_file():
            self._index_file = None
            self._where = {name: single for name in self._open(single).handle.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise WeightsError(
                f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} found (is this a model directory?)"
            )

    def _load_index(self, index: Path) -> dict[str, Path]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise WeightsError(f"{index}: cannot read the shard index: {e}") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            raise WeightsError(f"{index}: 'weight_map' must map tensor names to shard file names")
        out: dict[str, Path] = {}
        for name, fname in wm.items():
            shard = (self.path / fname).resolve()
            if shard.parent != self.path.resolve():
                raise WeightsError(f"{index}: tensor {name}: shard {fname!r} is outside the model directory")
            out[name] = shard
        return out

    def _open(self, file: Path, tensor: str | None = None) -> _Shard:
        shard = self._shards.get(file)
        if shard is not None:
            return shard
        from safetensors import SafetensorError, safe_open

        what = f" (needed for tensor {tensor})" if tensor else ""
        if not file.is_file():
            raise WeightsError(f"{file}: shard file missing{what}")
        try:
            h = safe_open(str(file), framework="pt")
        except SafetensorError as e:
            msg = _diagnose(file, str(e))
            raise WeightsError(msg + (f" (while loading tensor {tensor})" if tensor else "")) from None
        except OSError as e:
            raise WeightsError(f"{file}: cannot open{what}: {e}") from None
        try:  # safe_open has checked it: offsets inside the file, sizes matching shapes
            header, data_start = _read_header(file)
            where = {
                k: (v["dtype"], tuple(v["shape"]), data_start + v["data_offsets"][0],
                    v["data_offsets"][1] - v["data_offsets"][0])
                for k, v in header.items() if k != "__metadata__"
            }  # fmt: skip
            shard = _Shard(h, FileReader(file), where)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise WeightsError(f"{file}: cannot read its header{what}: {e}") from None
        self._shards[file] = shard
        return shard

    def _file_of(self, name: str) -> Path:
        f = self._where.get(name)
        if f is None:
            where = self._index_file or (self.path / SINGLE_FILE)
            raise WeightsError(f"{where}: tensor {name} is missing")
        return f

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._file_of(name)
        shard = self._open(file, name)
        if name not in shard.where:
            raise WeightsError(f"{file}: tensor {name}: not in this file's header")
        return shard.where[name][1]

    def load(
        self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        file = self._file_of(name)
        shard = self._open(file, name)
        if name not in shard.where:
            raise WeightsError(f"{file}: tensor {name}: not in this file's header")
        stored, shape, offset, nbytes = shard.where[name]
        if stored in _ST_DTYPES:
            raw = shard.reader.tensor(offset, nbytes, f"tensor {name}")
            t = raw.view(_ST_DTYPES[stored]).reshape(shape)
        else:  # a dtype torch has no name for here: safetensors converts it (through its map)
            try:
                t = shard.handle.get_tensor(name)
            except Exception as e:  # safetensors raises its own Rust error types
                raise WeightsError(f"{file}: tensor {name}: cannot read: {e}") from None
        return t.to(device=device, dtype=dtype)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.reader.close()
        self._shards.clear()


def _diagnose(file: Path, message: str) -> str:
    """Explain a safetensors open failure: a corrupt header, or which tensor a truncation cut."""
    base = f"{file}: not a valid safetensors file: {message}"
    try:
        size = file.stat().st_size
        if size < 8:
            return f"{file}: truncated: {size} bytes, shorter than the 8-byte header length"
        with file.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            return f"{file}: corrupt safetensors header: header length {n} exceeds file size {size}"
        header, data_start = _read_header(file)
    except (OSError, ValueError, UnicodeDecodeError):
        return base
    data_len = size - data_start
    cut = [
        k
        for k, info in header.items()
        if k != "__metadata__"
        and isinstance(info, dict)
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and info["data_offsets"][1] > data_len
    ]
    if cut:
        cut.sort(key=lambda k: header[k]["data_offsets"][0])
        return (
            f"{file}: truncated: tensor {cut[0]} (and {len(cut) - 1} more) ends past the end of "
            f"the file ({size} bytes)"
        )
    return base


# ------------------------------------------------------------------------------ entry point
def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a model directory (config.json + safetensors, single or sharded) or a ``.gguf`` file.

    Reads only config and headers; tensors are read later by whoever owns them.
    """
    # lazy: tokenizers and jinja2 cost ~24 ms to import, which a module importing this one need not pay
    from swarm.model.tokenizer import resident_bytes as tokenizer_bytes

    p = Path(path)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise WeightsError(f"{p}: GGUF file not found")
        from swarm.model import gguf  # lazy: written by the model-gguf helper

        config = gguf.config_from_gguf(p)
        args = ModelArgs.from_config(config, where=f"{p} (GGUF metadata)")
        sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        src = gguf.GGUFSource(p)
        from swarm.model.gguf_quant import stored_head_quant as head_of_gguf

        args = dataclasses.replace(args, tokenizer_bytes=tokenizer_bytes(gguf_metadata=src.file.metadata),
                                   head_stored=head_of_gguf(src))  # fmt: skip
        return Checkpoint(path=p, args=args, source=src, config_sha256=sha)
    if not p.is_dir():
        raise ConfigError(f"{p}: not a model directory or a .gguf file")
    raw, config = read_config(p)
    args = ModelArgs.from_config(config, where=str(p / "config.json"))
    from swarm.model.packaged import stored_head_quant as head_of_dir

    args = dataclasses.replace(args, tokenizer_bytes=tokenizer_bytes(p), head_stored=head_of_dir(p))
    return Checkpoint(
        path=p,
        args=args,
        source=SafetensorsSource(p),
        config_sha256=hashlib.sha256(raw).hexdigest(),
    )
