"""A node's settings, built once: from ``join``'s config file and flags, or a settings file.

``NodeSettings`` is the one description of a peer that :func:`swarm.node.peer.run_peer` (the
composition root) builds a node from. ``join`` fills it from the TOML config and its flags
(swarm/cli/settings.py); ``python -m swarm.node SETTINGS.json`` (the local swarms of the demo,
tests and benchmarks) from a JSON file through :func:`settings_from_file`, which takes every key
by its field name and the dataclass's own defaults for the rest, so no default is written twice.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import UsageError
from swarm.manifest.schema import DEFAULT_CONTEXT
from swarm.planner import ModelSpec

if TYPE_CHECKING:  # torch is imported only by a peer that holds layers (join --no-serve never does)
    import torch

    from swarm.model.config import ModelArgs


@dataclass
class NodeSettings:
    seed: bytes
    swarm_id: str
    secret: bytes
    model_dir: Path | None  # None: a member that holds no layers (join --no-serve): membership only
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()  # addresses to advertise instead of the listen ones (e.g. behind a proxy)
    bootstrap: tuple[str, ...] = ()
    memory_bytes: int = 0  # everything the peer uses (planner/budget.py); 0 = what the device has free (model/devices.py)
    dtype: Any = None  # a torch.dtype; None: bfloat16
    quant: str = "none"  # the invite's: how the decoder layers are held (swarm.model.quant)
    device: str = "cpu"  # cpu, cuda:N or mps, already resolved (swarm.model.devices.resolve_device)
    device_name: str = ""  # what the advert calls this machine (at most 128 characters); "": the device's own name
    threads: int = 1
    coordinator_ok: bool = True
    expect_peers: int = 0  # plan once this many members (us included) are present
    settle_s: float = 3.0
    context_tokens: int = DEFAULT_CONTEXT  # the invite's (the swarm's context); the model's maximum caps it
    kv_cache: str = "auto"  # the invite's: how every stage holds its KV cache (swarm.model.kvcache)
    draft: str = "ngram"
    chunk_timeout: float = 30.0
    revoked: frozenset[str] = frozenset()
    fastpath: bool = True  # activations over a direct sealed socket when one can be opened
    fastpath_port: int = 0
    fastpath_host: str = ""  # IP the direct socket binds (default: the first /ip4 listen address)
    fastpath_advertise: tuple[str, ...] = ()  # "ip:port" to announce (e.g. behind a proxy or NAT)
    # generations whose KV this node's stage reserves inside memory_bytes (planner/budget.py; join
    # --sessions, node.sessions): in its advert, so a leader plans its block with this count (Peer.sessions),
    # and its spec's, the count a leader plans peers whose advert lacks one with
    sessions: int = 8
    # a stage's one-token decode steps and verify chunks through compiled graphs (join --compile; model/compiled.py):
    # this node's choice, compiled before it serves; a stage that cannot compile serves eagerly
    compile: bool = False
    # the longest attention span compiled (join --compile-span; compiled.LONGEST_SPAN): a power of
    # two from MIN_COMPILE_SPAN; steps at later positions run eagerly (check_compile_span)
    compile_span: int = 1024
    # the leader's wait for a planned block to load (fetch, load, compile: node/plan/leader.py); a
    # compiling node stops adding spans once its load has taken half of it (runtime.warm_within),
    # so compiling never makes the wait run out (every node's default is the same; tests shorten it)
    load_timeout_s: float = 600.0
    compute_delay_s: float = 0.0  # fault injection (load tests): every forward and head call blocks this much longer
    relay: bool = False  # use the bootstrap nodes as relays and hole punch (swarm.node.members.discovery)
    mdns: bool = False  # announce and discover peers on the LAN
    # fetching its slice (swarm.fetch): the cache directory of the invite's model manifest
    # (model_dir then points into it), the origin's base URLs, and the cache's disk budget (0: none)
    fetch_dir: Path | None = None
    origin: tuple[str, ...] = ()
    disk_bytes: int = 0


MIN_COMPILE_SPAN = 64  # compiled.MIN_SPAN, the shortest span a graph reads (a test holds them equal)


def compile_span_help(default: int) -> str:
    """``--compile-span``'s help (join, demo): what it is, its default, and the trade it sets."""
    graphs = default.bit_length() - MIN_COMPILE_SPAN.bit_length() + 1
    return (f"With --compile: the longest attention span this node compiles, a power of two from {MIN_COMPILE_SPAN} "
            f"(default {default}: {graphs} graphs, spans {MIN_COMPILE_SPAN} to {default}). A longer span compiles more "
            "graphs before the node serves (~5-25 s each on a small CPU, longer for a block of many layers; less "
            "from inductor's on-disk cache) and leaves fewer decode steps eager (steps past it run eagerly); a "
            "shorter one serves sooner.")


def check_compile_span(span: int, *, compile: bool, where: str = "--compile-span") -> int:
    """``span`` if it is a span a node can compile: a whole power of two from MIN_COMPILE_SPAN to the
    largest context an invite may name, and asked for with ``compile``; a UsageError naming
    ``where`` and what to give otherwise (a rounded value would compile other graphs than asked)."""
    from swarm.manifest.schema import MAX_CONTEXT

    if not compile:
        raise UsageError(f"{where} {span}: only a compiled node compiles spans; add --compile, or drop {where}")
    whole = isinstance(span, int) and not isinstance(span, bool)
    if not whole or not MIN_COMPILE_SPAN <= span <= MAX_CONTEXT or span & (span - 1):
        near = MIN_COMPILE_SPAN  # the power of two at or below it (at least the smallest span)
        while whole and 2 * near <= min(span, MAX_CONTEXT):
            near *= 2
        raise UsageError(f"{where} {span!r}: expected a power of two from {MIN_COMPILE_SPAN} to {MAX_CONTEXT} "
                         f"(a compiled graph reads a power-of-two span of the cache), such as {near}")
    return span


def model_type(model_dir: object) -> str | None:
    """The checkpoint's model_type (config.json or GGUF metadata); None when it cannot be read
    here (loading the model reports that properly, with its own error)."""
    if not isinstance(model_dir, str | Path):
        return None
    from swarm.model.weights import open_checkpoint

    try:
        return open_checkpoint(Path(model_dir)).args.architecture
    except Exception:
        return None


def plan_memory(memory_bytes: int, dtype: torch.dtype) -> int:
    """The memory a peer advertises, in the planner's unit: bytes at a 2-byte width.

    A ring mixes dtypes (each peer resolves ``--dtype auto`` for its own device), but the leader
    plans with one ModelSpec, and every peer must compute the same plan. So every spec is built
    at 2 bytes per value (bf16, ``Models.spec``) and a peer that serves 4-byte fp32 advertises half its
    memory: a block whose bf16 bytes fit in the half fits in fp32 in the whole. A quantized layer's
    packed integers do not widen, so the planner states them at this peer's own width (its
    advert's ``dtype_bytes``; planner ModelSpec.at_width)."""
    import torch

    return memory_bytes * 2 // torch.empty(0, dtype=dtype).element_size()


def overhead_bytes(args: ModelArgs, dtype: torch.dtype, device: str, *, coordinator: bool = True,
                   quant: str = "none") -> int:
    """This peer's fixed overhead (real bytes) outside the planned part: planner/budget.py (the
    default, as coordinator, is what an advert leaves out), its load-time peak a layer of its
    swarm's ``quant`` loaded (quant.layer_load_bytes)."""
    import torch

    from swarm.model.quant import layer_load_bytes
    from swarm.planner.budget import runtime_overhead

    load = layer_load_bytes(args, quant, dtype.itemsize)
    return runtime_overhead(torch.device(device).type, load, coordinator=coordinator, tokenizer_bytes=args.tokenizer_bytes)


def advert_memory(offered: int, dtype: torch.dtype, device: str, args: ModelArgs, quant: str = "none") -> int:
    """What a peer offering ``offered`` bytes in all advertises: the offer less its own overhead,
    in the planner's unit (plan_memory)."""
    return plan_memory(max(0, offered - overhead_bytes(args, dtype, device, quant=quant)), dtype)


def peak_bytes(args: ModelArgs, dtype: torch.dtype, device: str, spec: ModelSpec, block: tuple[int, int], *,
               coordinator: bool, draft_bytes: int = 0, margin: float = 1.0, at_load: bool = False,
               quant: str = "none") -> int:
    """A peer's whole predicted peak in real bytes, serving in ``dtype`` on ``device``: the planned
    part of ``spec`` (the planner's 2-byte unit, as ``draft_bytes``) at ``dtype``'s width, times
    ``margin``, plus its overhead in that role (``at_load``: before any session, budget.py; its
    load-time peak at the swarm's ``quant``, as the spec's layers). For
    a coordinator, the inverse of advert_memory (a stage's is its coordinator overhead less):
    ``status`` shows it beside the measured peak, local swarms offer it (launch.sized_offers)."""
    import torch

    from swarm.planner.budget import predicted_peak

    width = torch.empty(0, dtype=dtype).element_size()
    planned = predicted_peak(spec.at_width(width), block, coordinator=coordinator, draft_bytes=draft_bytes, at_load=at_load)
    return int(planned * width / 2 * margin) + overhead_bytes(args, dtype, device, coordinator=coordinator, quant=quant)


def planned_part(spec: ModelSpec, layers: float, *, coordinator: bool) -> int:
    """predicted_peak (planner/budget.py) of the heaviest ``int(layers)`` consecutive layers, plus
    the fraction of a layer ``layers`` has beyond them as slack (offers sized by hand)."""
    from swarm.planner.budget import predicted_peak

    whole = min(int(layers), spec.n_layers)
    start = max(range(spec.n_layers - whole + 1), key=lambda a: sum(spec.weights[a:a + whole]))
    return predicted_peak(spec, (start, start + whole), coordinator=coordinator) + int((layers - whole) * spec.bytes_per_layer)


def model_spec(args: ModelArgs, dtype: torch.dtype, context_tokens: int, quant: str = "none",
               kv_cache: str = "auto", sessions: int | None = None) -> ModelSpec:
    """The planner's view of the model as this node holds it (bytes per layer in ``dtype``, the
    KV cache of ``sessions`` sessions (default: a node's, NodeSettings.sessions) in the swarm's
    format ``kv_cache``, one prefill chunk's activations)."""
    import torch

    from swarm.model.kvcache import kv_bytes_per_token_per_layer
    from swarm.model.quant import layer_bytes as quant_layer_bytes
    from swarm.model.quant import layer_bytes_each as quant_layer_bytes_each
    from swarm.model.quant import layer_compact_bytes_each
    from swarm.model.speculative import head_logit_values, inflight_bytes
    from swarm.planner.budget import PREFILL_CHUNK_TOKENS

    nbytes = torch.empty(0, dtype=dtype).element_size()
    return ModelSpec(
        n_layers=args.n_layers,
        layer_bytes=quant_layer_bytes(args, quant, nbytes),
        layer_bytes_each=tuple(quant_layer_bytes_each(args, quant, nbytes)),  # each layer at its own size
        # what keeps its size at any width, so a peer's own width can be stated (ModelSpec.at_width)
        compact_bytes_each=tuple(layer_compact_bytes_each(args, quant)) if nbytes == 2 else (),
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer(args, kv_cache, nbytes),
        coordinator_bytes=args.head_bytes(nbytes),
        # a quantized swarm's coordinator serving narrower than fp32 holds the head int8 beside it
        # (capability.swarm_head_quant): ModelSpec.coordinator_at counts it at such widths
        head_int8_bytes=args.head_int8_bytes() if quant != "none" and args.head_stored == "int8" else 0,
        context_tokens=context_tokens,
        sessions=max(1, NodeSettings.sessions if sessions is None else sessions),
        activation_bytes=args.activation_bytes(PREFILL_CHUNK_TOKENS, nbytes),
        inflight_bytes=inflight_bytes(args.dim, nbytes, context_tokens),
        head_logit_values=head_logit_values(args.vocab_size),
    )


def advertised_resources(s: NodeSettings) -> tuple[int, tuple[str, str]]:
    """(memory offered for layers, (device kind, name)) for this node's advert: ``memory_bytes``
    when the user gave one, else what the device has free (on a GPU, its memory less a margin)."""
    import torch

    from swarm.model.devices import auto_memory_bytes, describe_device

    device = torch.device(s.device)
    kind, name = describe_device(device)
    return s.memory_bytes or auto_memory_bytes(device), (kind, s.device_name[:128] or name)


_FROM_MANIFEST = ("seed", "swarm_id", "secret", "revoked", "quant", "bootstrap", "context_tokens", "kv_cache")


def settings_from_mapping(cfg: Mapping[str, Any], *, seed: bytes, manifest: Any) -> NodeSettings:
    """Settings from a JSON object of NodeSettings fields (by name; anything absent keeps the
    dataclass default) plus the invite (``manifest``: swarm ID, secret, bootstrap, quant, revoked)
    and the identity ``seed``. ``dtype``/``device`` may be "auto"; an unknown key is refused."""
    from swarm.model.devices import device_label, resolve_device
    from swarm.model.dtypes import resolve_dtype

    fields = {f.name: f for f in dataclasses.fields(NodeSettings)}
    bad = sorted(set(cfg) - set(fields) - {"manifest", "seed_file"} | (set(cfg) & set(_FROM_MANIFEST)))
    if bad:
        raise UsageError(f"node settings: unknown or invite-only key {bad[0]!r}")
    device = resolve_device(cfg.get("device", "auto"))
    mtype = model_type(cfg.get("model_dir"))  # auto never picks fp16 for a model that overflows it
    kw: dict[str, Any] = {"device": device_label(device),
                          "dtype": resolve_dtype(cfg.get("dtype", "auto"), device, mtype)}
    for name, v in cfg.items():
        if name in kw or name not in fields:
            continue
        default = fields[name].default
        if isinstance(default, tuple):
            v = tuple(v)
        elif name in ("model_dir", "fetch_dir"):
            v = None if v is None else Path(v)
        elif isinstance(default, int | float | str):  # bool is an int
            v = type(default)(v)
        kw[name] = v
    if "compile_span" in kw:
        check_compile_span(kw["compile_span"], compile=bool(kw.get("compile")), where="node settings: compile_span")
    return NodeSettings(
        seed=seed, swarm_id=manifest.swarm_id, secret=manifest.secret.value, revoked=frozenset(manifest.revoked),
        quant=manifest.quant, bootstrap=tuple(manifest.bootstrap), context_tokens=manifest.context_tokens,
        kv_cache=manifest.kv_cache, **kw,
    )  # fmt: skip


def settings_from_file(path: Path) -> NodeSettings:
    """``python -m swarm.node``'s settings file: NodeSettings fields by name, plus ``manifest``
    (the invite, verified on load) and ``seed_file`` (the identity seed, hex): secrets are read
    from those 0600 files, never from the command line, where ``ps`` would show them."""
    from swarm.manifest.manifest import read_manifest

    cfg = json.loads(path.read_text())
    manifest = read_manifest(Path(cfg["manifest"]))  # verified: signature, expiry, fields
    seed = bytes.fromhex(Path(cfg["seed_file"]).read_text().strip())
    return settings_from_mapping(cfg, seed=seed, manifest=manifest)
