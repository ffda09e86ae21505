"""Hash a model (directory or single file) for an invite, and check a local copy against one.

A directory's files are every regular, non-hidden file below it (relative POSIX paths); its
``config.json`` hash becomes ``config_sha256``. A single-file checkpoint (e.g. GGUF) has no
config.json: ``config_sha256`` is null and ``files`` holds that one file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from swarm.errors import ConfigError, WeightsError
from swarm.manifest.schema import MAX_FILES, ModelSpec

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
_CHUNK = 1 << 20


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def _model_files(path: Path) -> dict[str, Path]:
    if path.is_file():
        return {path.name: path}
    if not path.is_dir():
        raise WeightsError(f"model path {path} is neither a file nor a directory")
    out: dict[str, Path] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file() or p.is_symlink():
            continue
        out[rel.as_posix()] = p
    if not out:
        raise WeightsError(f"model directory {path} holds no files")
    if len(out) > MAX_FILES:
        raise WeightsError(
            f"model directory {path} holds {len(out)} files, over the invite limit {MAX_FILES}"
        )
    return out


def _counting(progress: Progress | None, total: int) -> Callable[[int], None]:
    """A byte counter for sha256_file that tells ``progress`` (done, total) as bytes are hashed."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    return tick


def describe_model(
    path: Path, name: str | None = None, progress: Progress | None = None
) -> ModelSpec:
    """Hash every file of the model at ``path`` into a ModelSpec for an invite."""
    files = _model_files(path)
    total = sum(p.stat().st_size for p in files.values())
    tick = _counting(progress, total)

    digests = {rel: sha256_file(p, tick) for rel, p in files.items()}
    config = digests.get("config.json") if path.is_dir() else None
    return ModelSpec(name or (path.stem if path.is_file() else path.name), config, digests)


def check_model(spec: ModelSpec, path: Path, progress: Progress | None = None) -> None:
    """ConfigError/WeightsError naming the first file that is missing or differs from ``spec``.

    ``path`` is the model directory, or for a single-file model the file itself (or its directory).
    """
    base = path.parent if path.is_file() else path
    if path.is_file() and set(spec.files) != {path.name}:
        raise WeightsError(
            f"{path} is one file but the invite's model {spec.name!r} has {len(spec.files)} files"
        )
    total = 0
    for rel in spec.files:
        p = base / rel
        if not p.is_file():
            raise WeightsError(
                f"model file {rel} is missing from {base} (the invite's model {spec.name!r} needs it)"
            )
        total += p.stat().st_size
    tick = _counting(progress, total)

    if spec.config_sha256 is not None:
        cfg = base / "config.json"
        if not cfg.is_file() or sha256_file(cfg) != spec.config_sha256:
            raise ConfigError(
                f"{cfg} differs from the invite's config_sha256: this is another model or version"
            )
    for rel, want in spec.files.items():
        got = sha256_file(base / rel, tick)
        if got != want:
            raise WeightsError(
                f"model file {rel} in {base} has sha256 {got[:16]}..., the invite expects {want[:16]}...: "
                "re-download it"
            )
