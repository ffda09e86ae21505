"""What a stage or the coordinator needs of the model, fetched into the cache and verified.

A stage holding layers [a, b) needs those layers' tensors (plus the few every peer reads to
build its config, e.g. a GGUF's ``rope_freqs``), every weight file's header (a GGUF split set is
opened as a whole; safetensors headers are a few KB) and the config; the coordinator needs the
non-layer tensors and every small file (tokenizer, chat template). :func:`local_path` is what the
loaders open afterwards: the cache directory, or its first GGUF file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from swarm.fetch.cache import FetchReport, ModelCache, Progress, Source

CONFIG_FILES = ("config.json", "model.safetensors.index.json")


def _base_files(cache: ModelCache) -> list[str]:
    m = cache.manifest
    return [f.path for f in m.weight_files()] + [p for p in CONFIG_FILES if p in m.files]


def fetch_block(cache: ModelCache, start: int, end: int, sources: Sequence[Source],
                progress: Progress | None = None) -> FetchReport:  # fmt: skip
    """Layers [start, end) into the cache (nothing moves for what it already holds)."""
    return cache.ensure(cache.manifest.block(start, end), _base_files(cache), sources, progress)


def fetch_head(cache: ModelCache, sources: Sequence[Source], progress: Progress | None = None) -> FetchReport:
    """The coordinator's part: embedding, final norm, LM head, tokenizer and other small files."""
    m = cache.manifest
    return cache.ensure(m.head() + m.block(0, 0), _base_files(cache) + [f.path for f in m.small_files()],
                        sources, progress)  # fmt: skip


def local_path(cache: ModelCache) -> Path:
    """What ``open_checkpoint`` opens: the first GGUF file, or the directory."""
    m = cache.manifest
    if m.kind == "gguf":
        return cache.dir / sorted(f.path for f in m.weight_files())[0]
    return cache.dir
