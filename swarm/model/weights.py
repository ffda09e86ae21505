"""Tensor sources: read a checkpoint's tensors one by one, by Hugging Face name.

Theory of operation
-------------------
A stage must load only the tensors of its own layers, so nothing here reads a whole file:
``SafetensorsSource`` parses headers with ``safetensors.safe_open`` (which memory-maps the file)
and copies out just the tensors asked for. A sharded checkpoint is read through its
``model.safetensors.index.json`` and a shard file is opened only when one of its tensors is first
needed. GGUF files go through ``swarm.model.gguf`` (imported lazily, so this module works
without it).

Every foreign failure (safetensors' Rust errors, OS errors, bad JSON) becomes a
:class:`swarm.errors.WeightsError` naming the file and, when known, the tensor. A truncated file is
diagnosed by reading its header ourselves and naming the first tensor whose bytes run past the end.
"""

from __future__ import annotations

import hashlib
import json
import struct
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


# ------------------------------------------------------------------------------ safetensors
class SafetensorsSource:
    """A single ``model.safetensors`` or a sharded set described by an index json.

    ``path`` is the directory; files are opened lazily and kept open (memory-mapped) for reuse.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        single = self.path / SINGLE_FILE
        index = self.path / INDEX_FILE
        self._handles: dict[Path, Any] = {}
        if index.is_file():
            self._index_file: Path | None = index
            self._where = self._load_index(index)
        elif single.is_file():
            self._index_file = None
            handle = self._open(single)
            self._where = {name: single for name in handle.keys()}  # noqa: SIM118 (not a dict)
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

    def _open(self, file: Path, tensor: str | None = None) -> Any:
        h = self._handles.get(file)
        if h is not None:
            return h
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
        self._handles[file] = h
        return h

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
        h = self._open(file, name)
        try:
            return tuple(h.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own Rust error types
            raise WeightsError(f"{file}: tensor {name}: {e}") from None

    def load(
        self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        file = self._file_of(name)
        h = self._open(file, name)
        try:
            t = h.get_tensor(name)
        except Exception as e:
            raise WeightsError(f"{file}: tensor {name}: cannot read: {e}") from None
        return t.to(device=device, dtype=dtype)

    def close(self) -> None:
        self._handles.clear()


def _diagnose(file: Path, message: str) -> str:
    """Explain a safetensors open failure: a corrupt header, or which tensor a truncation cut."""
    base = f"{file}: not a valid safetensors file: {message}"
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return f"{file}: truncated: {size} bytes, shorter than the 8-byte header length"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                return f"{file}: corrupt safetensors header: header length {n} exceeds file size {size}"
            header = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return base
    if not isinstance(header, dict):
        return base
    data_len = size - 8 - n
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
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise WeightsError(f"{p}: GGUF file not found")
        from swarm.model import gguf  # lazy: written by the model-gguf helper

        config = gguf.config_from_gguf(p)
        args = ModelArgs.from_config(config, where=f"{p} (GGUF metadata)")
        sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        return Checkpoint(path=p, args=args, source=gguf.GGUFSource(p), config_sha256=sha)
    if not p.is_dir():
        raise ConfigError(f"{p}: not a model directory or a .gguf file")
    raw, config = read_config(p)
    args = ModelArgs.from_config(config, where=str(p / "config.json"))
    return Checkpoint(
        path=p,
        args=args,
        source=SafetensorsSource(p),
        config_sha256=hashlib.sha256(raw).hexdigest(),
    )
