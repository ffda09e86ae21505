"""What a stage or the coordinator needs of the model, fetched into the cache and verified.

A stage holding layers [a, b) needs those layers' tensors (plus the few every peer reads to
build its config, e.g. a GGUF's ``rope_freqs``), every weight file's header (a GGUF split set is
opened as a whole; safetensors headers are a few KB) and the config; the coordinator needs the
non-layer tensors and every small file (tokenizer, chat template). :func:`local_path` is what the
loaders open afterwards: the cache directory, or its first GGUF file. A user's own full copy is
checked the same way, in place (:func:`verify_in_place`): exactly the tensors a plan loads, once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from swarm.errors import WeightsError
from swarm.fetch.cache import FetchReport, ModelCache, Progress, Source
from swarm.manifest.model_manifest import LocalFiles, TensorEntry

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


# ------------------------------------------------------------------------ a local copy, in place
LOCAL_MEMO = ".local-verified.json"


def verify_in_place(cache: ModelCache, base: Path, tensors: Sequence[TensorEntry], files: Sequence[str]) -> int:
    """Check a user's own copy at ``base`` against the manifest, tensor by tensor, where it lies:
    only ``tensors`` (and ``files`` whole, the headers of the tensors' files), each once: what
    passed is remembered (by file size and mtime) in the cache, so a re-plan hashes only the new
    layers. Returns the bytes hashed; WeightsError naming every file and tensor that differs."""
    m = cache.manifest
    memo_path = cache.dir / LOCAL_MEMO
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    reader = LocalFiles(base)
    hashed, bad = 0, []
    by_file: dict[str, list[tuple[str, int, int, str]]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append((t.name, t.start, t.end, t.sha256))
    for name in files:
        by_file.setdefault(name, [])
    for path, items in sorted(by_file.items()):
        f = m.files[path]
        if f.is_weights:
            items = [("<header>", 0, f.header_end, str(f.header_sha256)), *items]
        else:
            items = [("<contents>", 0, f.size, str(f.sha256))]
        fp = base / path
        try:
            st = fp.stat()
        except OSError:
            raise WeightsError(f"{fp}: missing from the local copy (the invite's model needs it)") from None
        if st.st_size != f.size:
            raise WeightsError(f"{fp}: {st.st_size} bytes, the invite's model manifest says {f.size}: another revision?")
        stamp = [st.st_size, st.st_mtime_ns]
        entry = memo.get(str(fp))
        done = set(entry["verified"]) if entry and entry.get("stamp") == stamp else set()
        todo = [it for it in items if it[0] not in done]
        for (name, a, b, want), got in zip(todo, reader.hash_ranges(path, [(a, b) for _, a, b, _ in todo]), strict=True):
            hashed += b - a
            if got == want:
                done.add(name)
            else:
                bad.append(f"{path}: {'tensor ' + name if not name.startswith('<') else name[1:-1]}")
        memo[str(fp)] = {"stamp": stamp, "verified": sorted(done)}
    memo_path.write_text(json.dumps(memo))
    if bad:
        raise WeightsError(f"{base}: differs from the invite's model manifest: {'; '.join(bad[:4])}"
                           f"{f' (and {len(bad) - 4} more)' if len(bad) > 4 else ''}: re-download those files")  # fmt: skip
    return hashed


def verify_block_in_place(cache: ModelCache, base: Path, start: int, end: int) -> int:
    return verify_in_place(cache, base, cache.manifest.block(start, end), [p for p in CONFIG_FILES if p in cache.manifest.files])


def verify_head_in_place(cache: ModelCache, base: Path) -> int:
    m = cache.manifest
    return verify_in_place(cache, base, m.head(), [f.path for f in m.small_files()])
