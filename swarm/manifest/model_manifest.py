"""A model manifest: every tensor of a checkpoint by file, byte range and sha256, and its small files.

Theory of operation
-------------------
A peer that holds layers [a, b) needs exactly the byte ranges of those layers' tensors, plus each
weight file's header (to lay the file out) and the config; the coordinator needs the non-layer
tensors (embedding, final norm, head) and the tokenizer. The manifest says where each of those
lies in the *unmodified upstream files*, and what its bytes hash to, so a peer can fetch ranges
from anyone (the model's origin, or another member) and check each tensor before it uses it.

Format (canonical JSON: sorted keys, no whitespace, integers only)::

    {"format": "shard-swarm/model-manifest/1", "name": str, "kind": "safetensors" | "gguf",
     "quant": "none" | "int8" | "int4",
     "files": {relpath: {"size": int, "sha256": hex}                      (a small file)
                      | {"size": int, "header_end": int, "header_sha256": hex}},  (a weight file)
     "tensors": {name: {"file", "dtype", "shape", "start", "end", "sha256", "layer": int | null}}}

Tensor names and shapes are the file's own (GGUF: ``blk.3.attn_q.weight``, ``ne`` order). The
manifest's hash (:meth:`ModelManifest.digest`) is the sha256 of those canonical bytes; an invite
names the model by it. Built from a local copy (:class:`LocalFiles`) or from any
:class:`RangeReader` (an HTTP origin: swarm.fetch.origin).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from swarm.errors import WeightsError
from swarm.manifest.headers import FileTable, NeedMore, parse_header

FORMAT = "shard-swarm/model-manifest/1"
MAX_SMALL_FILE = 64 << 20  # tokenizer.json of the largest vocabularies is ~35 MB
SMALL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "model.safetensors.index.json",
)  # fmt: skip
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})  # read to build the config: every peer needs them
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk|h)\.(\d+)\.")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str | None = None  # a small file: its whole hash
    header_end: int = 0  # a weight file: where its data section starts
    header_sha256: str | None = None

    @property
    def is_weights(self) -> bool:
        return self.header_sha256 is not None

    def to_json(self) -> dict[str, Any]:
        if self.is_weights:
            return {"size": self.size, "header_end": self.header_end, "header_sha256": self.header_sha256}
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    sha256: str
    layer: int | None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape), "start": self.start,
                "end": self.end, "sha256": self.sha256, "layer": self.layer}  # fmt: skip


@dataclass(frozen=True)
class ModelManifest:
    name: str
    kind: str  # "safetensors" or "gguf"
    quant: str
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "kind": self.kind, "quant": self.quant,
                "files": {k: f.to_json() for k, f in sorted(self.files.items())},
                "tensors": {k: t.to_json() for k, t in sorted(self.tensors.items())}}  # fmt: skip

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def n_layers(self) -> int:
        layers = [t.layer for t in self.tensors.values() if t.layer is not None]
        return max(layers) + 1 if layers else 0

    def weight_files(self) -> list[FileEntry]:
        return [f for f in self.files.values() if f.is_weights]

    def block(self, start: int, end: int) -> list[TensorEntry]:
        """The tensors of layers [start, end), plus those every peer reads to build its config."""
        return [t for t in self.tensors.values()
                if (t.layer is not None and start <= t.layer < end) or t.name in CONFIG_TENSORS]  # fmt: skip

    def head(self) -> list[TensorEntry]:
        """The coordinator's tensors: every tensor outside the layers (embedding, norm, head)."""
        return [t for t in self.tensors.values() if t.layer is None]

    def block_bytes(self, start: int, end: int) -> int:
        return sum(t.nbytes for t in self.block(start, end))

    def small_files(self) -> list[FileEntry]:
        return [f for f in self.files.values() if not f.is_weights]


def parse_model_manifest(data: bytes, where: str = "model manifest") -> ModelManifest:
    """Strict: WeightsError naming the field that is missing or mistyped."""
    try:
        obj = json.loads(data)
        if obj.get("format") != FORMAT:
            raise WeightsError(f"{where}: format {obj.get('format')!r}, expected {FORMAT!r}")
        files = {}
        for path, f in obj["files"].items():
            if not _safe(path):
                raise WeightsError(f"{where}: file {path!r} is not a safe relative path")
            if "header_sha256" in f:
                files[path] = FileEntry(path, _int(f["size"]), None, _int(f["header_end"]), _hex(f["header_sha256"]))
            else:
                files[path] = FileEntry(path, _int(f["size"]), _hex(f["sha256"]))
        tensors = {}
        for name, t in obj["tensors"].items():
            if t["file"] not in files or not files[t["file"]].is_weights:
                raise WeightsError(f"{where}: tensor {name}: file {t['file']!r} is not a weight file here")
            e = TensorEntry(name, str(t["file"]), str(t["dtype"]), tuple(_int(x) for x in t["shape"]),
                            _int(t["start"]), _int(t["end"]), _hex(t["sha256"]),
                            None if t["layer"] is None else _int(t["layer"]))  # fmt: skip
            if not files[e.file].header_end <= e.start <= e.end <= files[e.file].size:
                raise WeightsError(f"{where}: tensor {name}: bytes [{e.start}, {e.end}) outside {e.file}'s data")
            tensors[name] = e
        return ModelManifest(str(obj["name"]), str(obj["kind"]), str(obj.get("quant", "none")), files, tensors)
    except WeightsError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{where}: malformed model manifest ({type(e).__name__}: {e})") from None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _hex(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError(f"expected a sha256 hex digest, got {v!r}")
    return v


def _safe(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and "\\" not in path and all(p not in ("", ".", "..") for p in parts)


# ----------------------------------------------------------------------------------- building
class RangeReader(Protocol):
    """Bytes of a model's files by relative path (a local copy, or an origin)."""

    def size(self, path: str) -> int | None: ...  # None: no such file

    def read(self, path: str, start: int, end: int) -> bytes: ...

    def hash_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[str]: ...


class LocalFiles:
    """A model directory (or a GGUF file's directory) as a RangeReader."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def size(self, path: str) -> int | None:
        p = self.base / path
        return p.stat().st_size if p.is_file() else None

    def read(self, path: str, start: int, end: int) -> bytes:
        with open(self.base / path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def hash_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[str]:
        out = []
        with open(self.base / path, "rb") as f:
            for a, b in ranges:
                f.seek(a)
                h, left = hashlib.sha256(), b - a
                while left > 0 and (chunk := f.read(min(left, 1 << 22))):
                    h.update(chunk)
                    left -= len(chunk)
                if left:
                    raise WeightsError(f"{self.base / path}: ends inside bytes [{a}, {b})")
                out.append(h.hexdigest())
        return out


def read_table(reader: RangeReader, path: str, kind: str, first: int = 1 << 16) -> tuple[FileTable, bytes]:
    """A weight file's tensor table and its header bytes, read with as few ranged reads as the
    header's length allows (one for most files, two for a safetensors file over ``first``)."""
    size = reader.size(path)
    if size is None:
        raise WeightsError(f"{path}: not found")
    want = min(first, size)
    while True:
        prefix = reader.read(path, 0, want)
        try:
            table = parse_header(kind, prefix, path)
        except NeedMore as more:
            if want >= size:
                raise WeightsError(f"{path}: truncated: the file ends inside its header ({size} bytes)") from None
            want = min(more.size, size)
            continue
        if table.header_end > size or any(t.end > size for t in table.tensors):
            raise WeightsError(f"{path}: truncated: its tensors run past the end of the file ({size} bytes)")
        return table, prefix


def weight_files(reader: RangeReader, names: Iterable[str]) -> tuple[str, list[str]]:
    """(kind, weight files) among ``names``: a GGUF (or its split set), else safetensors."""
    names = list(names)
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if ggufs:
        m = _SPLIT.search(ggufs[0])
        if m is None:
            return "gguf", ggufs[:1]
        stem, count = ggufs[0][: m.start()], int(m.group(2))
        return "gguf", [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    if "model.safetensors.index.json" in names:
        index = json.loads(reader.read("model.safetensors.index.json", 0, reader.size("model.safetensors.index.json") or 0))
        return "safetensors", sorted(set(index["weight_map"].values()))
    if "model.safetensors" in names:
        return "safetensors", ["model.safetensors"]
    raise WeightsError(f"no model.safetensors, shard index or .gguf among {sorted(names)[:8]}")


def build_manifest(reader: RangeReader, names: Iterable[str], *, name: str, quant: str = "none") -> ModelManifest:
    """Hash every tensor (one pass over each weight file) and every small file in ``names``."""
    names = [n for n in names if reader.size(n) is not None]
    kind, weights = weight_files(reader, names)
    files: dict[str, FileEntry] = {}
    tensors: dict[str, TensorEntry] = {}
    for path in weights:
        size = reader.size(path)
        if size is None:
            raise WeightsError(f"{path}: weight file missing (split set or shard index names it)")
        table, prefix = read_table(reader, path, kind)
        hashes = reader.hash_ranges(path, [(0, table.header_end)] + [(t.start, t.end) for t in table.tensors])
        files[path] = FileEntry(path, size, None, table.header_end, hashes[0])
        for t, digest in zip(table.tensors, hashes[1:], strict=True):
            if t.name in tensors:
                raise WeightsError(f"{path}: tensor {t.name} is also in {tensors[t.name].file}")
            tensors[t.name] = TensorEntry(t.name, path, t.dtype, t.shape, t.start, t.end, digest, layer_of(t.name))
    for path in names:
        size = reader.size(path)
        if path in files or path.endswith((".safetensors", ".gguf")) or size is None or size > MAX_SMALL_FILE:
            continue
        files[path] = FileEntry(path, size, reader.hash_ranges(path, [(0, size)])[0])
    return ModelManifest(name, kind, quant, files, tensors)


def manifest_of_path(path: Path, *, name: str | None = None, quant: str = "none") -> ModelManifest:
    """The manifest of a local model directory or GGUF file (any split of a set)."""
    if path.is_file():
        base = path.parent
        m = _SPLIT.search(path.name)
        names = [path.name] if m is None else [p.name for p in base.glob(path.name[: m.start()] + "-*-of-*.gguf")]
        label = name or (path.name[: m.start()] if m else path.stem)
    elif path.is_dir():
        base = path
        names = sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                       if p.is_file() and not any(s.startswith(".") for s in p.relative_to(base).parts))  # fmt: skip
        label = name or path.name
    else:
        raise WeightsError(f"{path}: neither a model directory nor a file")
    return build_manifest(LocalFiles(base), names, name=label, quant=quant)
