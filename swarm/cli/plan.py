"""``shard-swarm plan``: show what a swarm would do, from a peers file, before running anything.

    shard-swarm plan --peers peers.json --model ./SmolLM2-135M-Instruct
    shard-swarm plan --peers peers.json --layers 80 --layer-gb 0.85 --coordinator-gb 2.1 --json
    shard-swarm plan --peers peers.json --model ./Llama-3.3-70B --quant int4

With ``--model`` the layers are budgeted at their resident bytes under ``--quant`` (weights held
as int8/int4, norms in the serving dtype) plus the KV cache at ``--context``; when the model does
not fit, the error says which other setting would.

The peers file is the format a running swarm exports (see swarm/planner/peersfile.py). Exit
codes: 0 planned; 2 bad flags or a malformed peers file; 3 an unreadable model config;
5 the swarm cannot hold the model or form a ring (the message says by how much or who).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from swarm.cli import ui
from swarm.errors import PlanningError, UsageError
from swarm.manifest.schema import QUANTS
from swarm.node.ring.capacity import MIN_SESSIONS
from swarm.planner import GB, ModelSpec, Plan, parse_peers_file, plan
from swarm.planner.budget import PREFILL_CHUNK_TOKENS, predicted_peak

SPECULATION_G = (1, 2, 4)  # accepted tokens per traversal shown in the output


def read_peers_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"peers file {path}: not found") from None
    except OSError as exc:
        raise UsageError(f"peers file {path}: cannot read ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"peers file {path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None


def model_spec(
    *,
    model: Path | None,
    layers: int | None,
    layer_gb: float | None,
    coordinator_gb: float | None,
    draft_gb: float,
    kv_kb_per_token: float | None,
    context: int,
    dtype_bytes: int,
    quant: str = "none",
    sessions: int = 1,
) -> ModelSpec:
    """A ModelSpec from --model (its config.json) or from --layers/--layer-gb."""
    if context < 0:
        raise UsageError("--context must be >= 0")
    if sessions < 1:
        raise UsageError("--sessions must be >= 1")
    if quant not in QUANTS:
        raise UsageError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if model is not None:
        if layers is not None or layer_gb is not None:
            raise UsageError("give either --model or --layers/--layer-gb, not both")
        from swarm.model.config import ModelArgs
        from swarm.model.quant import layer_bytes_each, layer_compact_bytes_each
        from swarm.model.speculative import head_logit_values, inflight_bytes

        if model.is_file() and model.suffix == ".gguf":
            from swarm.model.gguf import config_from_gguf

            args = ModelArgs.from_config(config_from_gguf(model), where=str(model))
        else:
            args = ModelArgs.from_dir(model)
        coord = args.head_bytes(dtype_bytes) if coordinator_gb is None else coordinator_gb * GB
        kv = (
            args.kv_bytes_per_token_per_layer(dtype_bytes)
            if kv_kb_per_token is None
            else kv_kb_per_token * 1000
        )
        each = layer_bytes_each(args, quant, dtype_bytes)
        return ModelSpec(
            n_layers=args.n_layers,
            layer_bytes=max(each),
            layer_bytes_each=tuple(each),
            # in the planner's unit, what keeps its size at a peer's own width (its dtype_bytes)
            compact_bytes_each=tuple(layer_compact_bytes_each(args, quant)) if dtype_bytes == 2 else (),
            kv_bytes_per_token_per_layer=int(kv),
            coordinator_bytes=int(coord + draft_gb * GB),
            context_tokens=context,
            sessions=sessions,
            activation_bytes=args.activation_bytes(PREFILL_CHUNK_TOKENS, dtype_bytes),
            inflight_bytes=inflight_bytes(args.dim, dtype_bytes, context),
            head_logit_values=head_logit_values(args.vocab_size),
        )
    if layers is None or layer_gb is None:
        raise UsageError("give --model PATH, or --layers N with --layer-gb G")
    if quant != "none":
        raise UsageError("--quant needs --model (with --layer-gb, give the quantized size itself)")
    if layers < 1 or layer_gb <= 0:
        raise UsageError("--layers must be >= 1 and --layer-gb > 0")
    return ModelSpec(
        n_layers=layers,
        layer_bytes=int(round(layer_gb * GB)),
        kv_bytes_per_token_per_layer=int(round((kv_kb_per_token or 0.0) * 1000)),
        coordinator_bytes=int(round(((coordinator_gb or 0.0) + draft_gb) * GB)),
        context_tokens=context,
        sessions=sessions,
    )


def plan_json(p: Plan) -> dict[str, Any]:
    out = p.to_json()
    out["predicted_tokens_per_s_with_g"] = {
        str(g): p.predicted_tokens_per_s(g) for g in SPECULATION_G
    }
    return out


def predicted_peaks(p: Plan, spec: ModelSpec, peers: Any) -> dict[str, int]:
    """Each placed peer's predicted peak (planner/budget.py): the planned part, against what it
    advertises (its offer less its own runtime overhead), with the KV of its own sessions, at its
    own width (Peer.own)."""
    by_id = {q.id: q for q in peers}

    def peak(pid: str, blk: tuple[int, int]) -> int:
        q = by_id.get(pid)
        return predicted_peak(spec if q is None else q.own(spec), blk, coordinator=pid == p.coordinator,
                              draft_bytes=0 if q is None else q.draft_bytes)  # fmt: skip

    out = {pid: peak(pid, blk) for pid, blk in p.blocks.items()}
    if p.coordinator not in out:
        out[p.coordinator] = peak(p.coordinator, (0, 0))
    return out


def bytes_to_move(p: Plan, spec: ModelSpec, peers: Any) -> dict[str, int]:
    """What each placed peer must fetch: its block's layers it does not hold (the peers file's
    ``held``), and the head on the coordinator unless it holds it (``held_head``)."""
    by = {q.id: q for q in peers}
    out = {pid: by[pid].moved_bytes(spec, s, e, coordinator=pid == p.coordinator) for pid, (s, e) in p.blocks.items()}
    if p.coordinator not in out:
        out[p.coordinator] = by[p.coordinator].moved_bytes(spec, 0, 0, coordinator=True)
    return out


def _layer_line(spec: ModelSpec) -> str:
    kv = spec.kv_bytes_per_layer
    many = f"{spec.sessions} sessions of " if spec.sessions > 1 else ""
    tail = f" + KV {kv / GB:.3f} GB for {many}{spec.context_tokens} tokens"
    if spec.uniform:
        return f"{spec.bytes_per_layer / GB:.3f} GB = weights {spec.layer_bytes / GB:.3f} GB{tail}"
    runs: list[str] = []  # consecutive layers of one size, e.g. "0-2: 0.402 GB"
    start = 0
    w = spec.weights
    for i in range(1, len(w) + 1):
        if i == len(w) or w[i] != w[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            runs.append(f"{span}: {w[start] / GB:.3f} GB")
            start = i
    return f"weights by layer {'; '.join(runs)}{tail} each"


def plan_or_hint(spec_for: Any, quant: str, peers: Any, latency: Any) -> tuple[Plan, ModelSpec]:
    """Plan with ``spec_for(quant)``; when it does not fit, say which other setting would."""
    spec = spec_for(quant)
    try:
        return plan(spec, peers, latency), spec
    except PlanningError as exc:
        if not str(exc).startswith("not enough memory"):
            raise
        for other in QUANTS:
            if other == quant:
                continue
            try:
                plan(spec_for(other), peers, latency)
            except PlanningError:
                continue
            name = "bf16" if quant == "none" else quant
            raise PlanningError(f"{exc}. It does not fit in {name} across these peers; fits with "
                                f"--quant {other}") from None  # fmt: skip
        raise


def print_plan(p: Plan, spec: ModelSpec, memory: dict[str, int], speed: dict[str, float],
               peaks: dict[str, int], moves: dict[str, int]) -> None:
    rows: list[list[Any]] = []
    for k, pid in enumerate(p.ring):
        s, e = p.blocks[pid]
        used = peaks[pid]
        role = "stage+coord" if pid == p.coordinator else "stage"
        rows.append(
            [
                k + 1,
                pid,
                role,
                f"[{s}, {e})",
                e - s,
                f"{used / GB:.2f}/{memory[pid] / GB:.2f}",
                f"{(e - s) * speed[pid]:.2f}",
                f"{p.hops_ms[k]:.2f}",
                f"{moves[pid] / GB:.2f}",
            ]
        )
    if p.coordinator not in p.blocks:
        rows.insert(
            0,
            [
                0,
                p.coordinator,
                "coordinator",
                "-",
                0,
                f"{peaks[p.coordinator] / GB:.2f}/{memory[p.coordinator] / GB:.2f}",
                "0.00",
                "-",
                f"{moves[p.coordinator] / GB:.2f}",
            ],
        )
    ui.print_table(
        f"Plan (epoch {p.epoch}): {len(p.ring)} stage(s), coordinator {p.coordinator}",
        [
            "#",
            "peer",
            "role",
            "layers",
            "n",
            "GB peak/offered",
            "compute ms",
            "hop in ms",
            "GB to fetch",
        ],
        rows,
    )
    summary: list[list[Any]] = [
        [
            "predicted traversal",
            f"{p.predicted_traversal_ms:.2f} ms "
            f"(hops {p.predicted_latency_ms:.2f} + compute {p.predicted_compute_ms:.2f}; "
            f"last hop {p.hops_ms[-1]:.2f} back to the coordinator)",
        ],
    ]
    for g in SPECULATION_G:
        summary.append(
            [f"tokens/s, {g} accepted per traversal", f"{p.predicted_tokens_per_s(g):.1f}"]
        )
    summary.append(["bytes per layer", _layer_line(spec)])
    summary.append(["to fetch", f"{sum(moves.values()) / GB:.2f} GB (layers and head not held where planned)"])
    summary.append(["standbys", ", ".join(p.standbys) or "-"])
    if p.note:
        summary.append(["note", p.note])
    ui.print_table("Prediction", ["", ""], summary)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        peers: Path = typer.Option(
            ..., "--peers", help="Peers file (JSON) as a running swarm exports it."
        ),
        model: Path | None = typer.Option(
            None, "--model", help="Model directory (config.json) or .gguf file."
        ),
        layers: int | None = typer.Option(
            None, "--layers", help="Number of decoder layers (instead of --model)."
        ),
        layer_gb: float | None = typer.Option(None, "--layer-gb", help="GB of weights per layer."),
        coordinator_gb: float | None = typer.Option(
            None,
            "--coordinator-gb",
            help="GB the coordinator holds (embedding + head); default from --model, else 0.",
        ),
        draft_gb: float = typer.Option(
            0.0, "--draft-gb", help="GB of the draft model (on the coordinator)."
        ),
        kv_kb_per_token: float | None = typer.Option(
            None,
            "--kv-kb-per-token",
            help="KV cache kB per token per layer; default from --model, else 0.",
        ),
        context: int = typer.Option(
            4096, "--context", help="Context tokens of KV cache to reserve per layer."
        ),
        dtype_bytes: int = typer.Option(
            2, "--dtype-bytes", help="Bytes per weight when serving (bf16: 2)."
        ),
        quant: str = typer.Option(
            "none", "--quant", help="Layers held as none (the dtype), int8, int4 or mxfp4 (MoE experts only) (needs --model)."
        ),
        sessions: int = typer.Option(
            MIN_SESSIONS, "--sessions", help="Sessions whose KV cache a stage reserves where the peers file gives its peer none (a node's `sessions`)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ) -> None:
        """Show the coordinator, ring order, layer blocks and predicted speed for a set of peers."""
        def spec_for(q: str) -> ModelSpec:
            return model_spec(
                model=model,
                layers=layers,
                layer_gb=layer_gb,
                coordinator_gb=coordinator_gb,
                draft_gb=draft_gb,
                kv_kb_per_token=kv_kb_per_token,
                context=context,
                dtype_bytes=dtype_bytes,
                quant=q,
                sessions=sessions,
            )

        spec_for(quant)  # bad flags are usage errors before the peers file is read
        pf = parse_peers_file(read_peers_file(peers), where=f"peers file {peers}")
        if model is None:
            spec = spec_for(quant)
            p = plan(spec, pf.peers, pf.latency())
        else:
            p, spec = plan_or_hint(spec_for, quant, pf.peers, pf.latency())
        if as_json:
            out = plan_json(p)
            out["quant"] = quant
            out["layer_bytes"] = spec.layer_bytes
            out["layer_bytes_each"] = list(spec.weights)
            out["kv_bytes_per_layer"] = spec.kv_bytes_per_token_per_layer * spec.context_tokens
            out["sessions"] = spec.sessions
            out["predicted_peak_bytes"] = predicted_peaks(p, spec, pf.peers)  # each peer's, against its offer
            out["bytes_to_move"] = bytes_to_move(p, spec, pf.peers)  # each placed peer's, not held yet
            ui.print_json(out)
        else:
            print_plan(
                p,
                spec,
                {q.id: q.memory_bytes for q in pf.peers},
                {q.id: q.ms_per_layer for q in pf.peers},
                predicted_peaks(p, spec, pf.peers),
                bytes_to_move(p, spec, pf.peers),
            )
