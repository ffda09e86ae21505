"""``shard-swarm model manifest DIR|FILE.gguf|URL``, and what ``join`` does to fetch its slice.

``model manifest`` writes a model manifest (swarm.manifest.model_manifest: every tensor's file,
byte range and sha256; the small files by hash) for a local copy, or for an origin URL by
streaming its files once; the JSON goes to ``--output`` (or stdout) and its hash to stderr. Give
the file to ``invite create --model-manifest`` with ``--origin``; ``join`` with no ``--model``
then fetches only its block (:func:`prepare_fetch`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import typer

from swarm.cli import ui
from swarm.errors import UsageError
from swarm.manifest.model_manifest import (
    SMALL_FILES,
    ModelManifest,
    build_manifest,
    manifest_of_path,
    parse_model_manifest,
)
from swarm.manifest.schema import QUANTS, ModelSpec

app = typer.Typer(help="Model manifests: every tensor's byte range and hash, for fetching slices.")


@app.command("manifest")
def manifest(
    source: str = typer.Argument(..., help="A model directory, a .gguf file (any split), or an http(s) URL of either."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write the manifest here (default: stdout)."),
    name: str | None = typer.Option(None, "--name", help="The model's name (default: the directory or file name)."),
    quant: str = typer.Option("none", "--quant", help="How the swarm serves it: none, int8 or int4."),
) -> None:
    """Hash every tensor of a model by byte range (headers read first; each file read once)."""
    if quant not in QUANTS:
        raise UsageError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if source.startswith(("http://", "https://")):
        m = manifest_of_url(source, name=name, quant=quant)
    else:
        with ui.progress(f"hashing {Path(source).name}"):
            m = manifest_of_path(Path(source), name=name, quant=quant)
    data = m.canonical_bytes() + b"\n"
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        output.write_bytes(data)
    size = sum(t.nbytes for t in m.tensors.values())
    ui.notice(f"model manifest {m.digest()}: {m.name}, {m.kind}, {len(m.tensors)} tensors ({ui.size(size)}) "
              f"in {len(m.weight_files())} files, {m.n_layers} layers")  # fmt: skip


def manifest_of_url(url: str, *, name: str | None, quant: str) -> ModelManifest:
    """Stream an origin's files once: a ``.../file.gguf`` URL, or a directory's base URL."""
    from swarm.fetch.origin import Origin

    if url.endswith(".gguf"):
        base, file = url.rsplit("/", 1)
        names = [file]
    else:
        base, names = url, [*SMALL_FILES, "model.safetensors"]
    origin = Origin(base)
    try:
        return build_manifest(origin, names, name=name or base.rstrip("/").rsplit("/", 1)[-1], quant=quant)
    finally:
        origin.close()


def read_model_manifest(path: Path) -> ModelManifest:
    try:
        return parse_model_manifest(path.read_bytes(), str(path))
    except OSError as e:
        raise UsageError(f"{path}: cannot read the model manifest: {e}") from None


def invite_spec(path: Path, origin: list[str], manifest_url: str | None) -> ModelSpec:
    """The invite's ``model`` for a model manifest: named by its hash, with where to fetch."""
    m = read_model_manifest(path)
    for u in [*origin, *([manifest_url] if manifest_url else [])]:
        if not u.startswith(("http://", "https://")):
            raise UsageError(f"{u!r}: an origin or manifest URL must start with http:// or https://")
    cfg = m.files.get("config.json")
    return ModelSpec(m.name, cfg.sha256 if cfg else None, {}, m.digest(), tuple(origin), manifest_url)


def prepare_fetch(spec: ModelSpec, disk: int | None, *, local: Path | None = None,
                  manifest_file: Path | None = None, from_members: Any = None) -> tuple[Path, Path]:  # fmt: skip
    """(the path the loaders open, the model's cache directory): the model manifest (``--model-manifest``,
    else the cache, else its URL) checked against the invite's hash; then the headers and config
    fetched, or with ``local`` (the user's own copy) nothing: it is verified tensor by tensor as loaded."""
    from swarm.fetch.cache import MANIFEST, ModelCache
    from swarm.fetch.origin import FetchError, Origin
    from swarm.fetch.slices import fetch_block, local_path
    from swarm.model.bundled import cache_dir

    assert spec.manifest_sha256 is not None
    root = cache_dir()
    cached = root / "models" / spec.manifest_sha256[:16] / MANIFEST
    data = manifest_file.read_bytes() if manifest_file is not None else cached.read_bytes() if cached.is_file() else None
    if data is None:
        if spec.manifest_url is None:
            raise UsageError("the invite's model has no manifest_url and no copy is cached: pass --model-manifest FILE")
        base, file = spec.manifest_url.rsplit("/", 1)
        o = Origin(base)
        size = o.size(file)
        if size is None or size > 256 << 20:
            raise FetchError(f"{spec.manifest_url}: no model manifest there (HTTP 404) or it is implausibly large")
        data = o.read(file, 0, size)
        o.close()
    m = parse_model_manifest(data, spec.manifest_url or str(cached))
    if m.digest() != spec.manifest_sha256:
        raise FetchError(f"{spec.manifest_url or cached}: the model manifest's hash {m.digest()[:16]}... is not "
                         f"the invite's {spec.manifest_sha256[:16]}...: another model or revision")  # fmt: skip
    cache = ModelCache(root, m, disk_budget=disk)
    if local is not None:
        return local, cache.dir
    sources = [Origin(u) for u in spec.origin]
    if not sources and from_members is not None:  # no origin: the members hold the model
        with ui.progress("fetching the model's headers and config from the swarm's members"):
            from_members(cache)
    with ui.progress("fetching the model's headers and config") as report:
        fetch_block(cache, 0, 0, sources, report)
    for s in sources:
        s.close()
    path = local_path(cache)
    if m.kind == "gguf":  # its tokenizer is in the header: converted once now, not by a coordinator mid-plan
        from swarm.errors import TokenizerError
        from swarm.model.tokenizer import Tokenizer

        with ui.progress("preparing the tokenizer (first run only)"), contextlib.suppress(TokenizerError):
            Tokenizer.load(path)
    return path, cache.dir


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="model")


HEADERS_WAIT_S = 120.0  # a bootstrap member that is not up yet is retried this long


def headers_from_members(seed: bytes, secret: bytes, swarm_id: str, bootstrap: list[str],
                         revoked: frozenset[str]) -> Any:  # fmt: skip
    """For an invite with no origin: a function that lands the model's weight headers and config
    in a cache from the invite's bootstrap members over /shard-swarm/tensors/1 (each checked
    against the manifest), before the node starts; they are retried until one answers."""

    def run(cache: Any) -> None:
        import trio

        from swarm.errors import SwarmError
        from swarm.fetch.peers import Holds
        from swarm.fetch.slices import CONFIG_FILES
        from swarm.net.host import open_host
        from swarm.node.compute.members import fetch_from_members

        m = cache.manifest
        files = [f.path for f in m.weight_files()] + [p for p in CONFIG_FILES if p in m.files]
        holds = Holds(frozenset(), frozenset(files))

        async def main() -> None:
            async with open_host(seed, ("/ip4/127.0.0.1/tcp/0",), secret=secret, swarm_id=swarm_id,
                                 revoked=revoked) as host:  # fmt: skip
                deadline = trio.current_time() + HEADERS_WAIT_S
                last: Exception | None = None
                while trio.current_time() < deadline:
                    peers = []
                    for addr in bootstrap:
                        with contextlib.suppress(SwarmError):
                            peers.append(await host.dial(addr, timeout=10))
                    try:
                        if peers:
                            await fetch_from_members(host, cache, [], files, {p: holds for p in peers})
                            return
                    except SwarmError as e:
                        last = e
                    await trio.sleep(1.0)
                raise UsageError(f"the invite names no origin and no bootstrap member served the model's headers "
                                 f"within {HEADERS_WAIT_S:.0f} s{f' ({last})' if last else ''}")  # fmt: skip

        trio.run(main)

    return run
